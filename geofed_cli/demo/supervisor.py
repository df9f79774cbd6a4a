"""When the demo restarts a daemon that exited: the shipped systemd units' rules, in one place.

The units (``deploy/systemd``) say ``Restart=on-failure``, ``RestartPreventExitStatus=2``
and ``StartLimitBurst=5`` within ``StartLimitIntervalSec=15min``. :class:`RestartPolicy`
decides the same for the demo's children: an exit with status 0 (a clean stop), 2 (a
configuration error: restarting cannot help) or by a "clean" signal (SIGTERM, SIGINT,
SIGHUP, SIGPIPE, as systemd counts them) is not restarted; any other exit (status 1, a
crash, SIGKILL, the OOM killer's SIGKILL) is, after a back-off that doubles from
``initial_delay_s`` up to ``max_delay_s``, unless ``burst`` restarts already happened
within ``interval_s``: then the daemon stays down and the demo fails, as a unit that hit
its start limit stays failed. Pure: the caller passes the clock's reading.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

from geofed.exit_codes import ExitCode

__all__ = ["RestartDecision", "RestartPolicy", "describe_exit"]

#: Signals systemd treats as a clean exit (not restarted by ``Restart=on-failure``).
_CLEAN_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE})


def describe_exit(returncode: int) -> str:
    """``exited with status 1`` or ``was killed by SIGKILL``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


@dataclass(frozen=True, slots=True)
class RestartDecision:
    """Whether to restart, after how long, and why (for the live view)."""

    restart: bool
    delay_s: float
    reason: str


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """``Restart=on-failure`` with back-off and a start limit (see the module docstring)."""

    initial_delay_s: float = 1.0
    max_delay_s: float = 30.0
    burst: int = 5
    interval_s: float = 900.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_delay_s <= self.max_delay_s:
            raise ValueError("need 0 < initial_delay_s <= max_delay_s")
        if self.burst < 1 or self.interval_s <= 0:
            raise ValueError("need burst >= 1 and interval_s > 0")

    def decide(self, returncode: int, restarts: Sequence[float], now: float) -> RestartDecision:
        """The decision for a child that ended with ``returncode``; ``restarts``: when it
        was restarted before (the same clock as ``now``)."""
        ended = describe_exit(returncode)
        if returncode == 0:
            return RestartDecision(False, 0.0, f"{ended}: a clean stop is not restarted")
        if returncode == ExitCode.CONFIG:
            return RestartDecision(
                False, 0.0, f"{ended} (configuration error): restarting cannot help"
            )
        if returncode < 0 and -returncode in _CLEAN_SIGNALS:
            return RestartDecision(False, 0.0, f"{ended}: a clean stop is not restarted")
        recent = [t for t in restarts if now - t < self.interval_s]
        if len(recent) >= self.burst:
            return RestartDecision(
                False,
                0.0,
                f"{ended}; restarted {len(recent)} times within {self.interval_s:.0f} s "
                "already: giving up",
            )
        delay = min(self.max_delay_s, self.initial_delay_s * 2 ** len(recent))
        return RestartDecision(
            True,
            delay,
            f"{ended}; restarting in {delay:.0f} s (restart {len(recent) + 1} of at most "
            f"{self.burst} within {self.interval_s:.0f} s)",
        )
