"""The notify protocol's pure parts, and the watchdog's schedule on simulated time.

What crosses a real unix datagram socket is in ``tests/integration/test_sdnotify.py``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import pytest

from geofed.sdnotify import (
    Notifier,
    NotifyEnvironmentError,
    run_watchdog,
    watchdog_interval,
    without_notify_env,
)


@pytest.mark.parametrize("environ", [{}, {"NOTIFY_SOCKET": ""}])
def test_without_a_socket_every_call_is_a_no_op(
    environ: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    notifier = Notifier.from_env(environ)
    assert not notifier.enabled
    assert not notifier.ready()
    assert not notifier.status("x")
    assert not notifier.watchdog()
    assert not notifier.stopping()
    assert caplog.records == []


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("relative/notify.sock", "absolute socket path or @abstract-name"),
        ("/" + "x" * 120, "longer than the 107 bytes"),
        ("@" + "x" * 120, "longer than the 108 bytes"),
        ("vsock:2:1234", "absolute socket path"),
    ],
)
def test_malformed_notify_socket_is_refused(value: str, message: str) -> None:
    with pytest.raises(NotifyEnvironmentError, match=message):
        Notifier.from_env({"NOTIFY_SOCKET": value})


def test_watchdog_interval() -> None:
    pid = os.getpid()
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": ""}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "250000", "WATCHDOG_PID": str(pid)}) == 0.25
    # Inherited by a child: the watchdog belongs to the parent.
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(pid + 1)}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "7"}, pid=7) == 1.0


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"WATCHDOG_USEC": "30s"}, "WATCHDOG_USEC='30s' is not an integer"),
        ({"WATCHDOG_USEC": "0"}, "must be positive"),
        ({"WATCHDOG_USEC": "-5"}, "must be positive"),
        ({"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "me"}, "WATCHDOG_PID='me'"),
    ],
)
def test_malformed_watchdog_environment_is_refused(environ: dict[str, str], message: str) -> None:
    with pytest.raises(NotifyEnvironmentError, match=message):
        watchdog_interval(environ)


def test_child_environment_drops_the_notify_variables() -> None:
    environ = {
        "NOTIFY_SOCKET": "/run/systemd/notify",
        "WATCHDOG_USEC": "30000000",
        "WATCHDOG_PID": "12",
        "PATH": "/usr/bin",
    }
    assert without_notify_env(environ) == {"PATH": "/usr/bin"}
    assert "NOTIFY_SOCKET" in environ


INTERVAL_S = 2.0  # pings every 1.0 s of simulated time: whole and half seconds add exactly


class SimulatedTime:
    """The watchdog's clock and sleep; a sleep moves the clock to its due time at once.

    ``block(start, end)`` holds the simulated event loop over that span, as a stuck call
    would: a sleep due inside it returns only at ``end``. When the clock reaches ``until``
    time stops (the next sleep never returns) and ``reached`` is set, for the test to
    cancel the watchdog.
    """

    def __init__(self, until: float) -> None:
        self.now = 0.0
        self.until = until
        self.reached = asyncio.Event()
        self.sleeps: list[float] = []
        self._blocked: list[tuple[float, float]] = []

    def clock(self) -> float:
        return self.now

    def block(self, start: float, end: float) -> None:
        self._blocked.append((start, end))

    async def sleep(self, seconds: float) -> None:
        assert seconds > 0, "the schedule never busy-loops"
        self.sleeps.append(seconds)
        due = self.now + seconds
        for start, end in self._blocked:
            if start <= due < end:
                due = end
        if due >= self.until:
            self.reached.set()
            await asyncio.Event().wait()
        self.now = due
        await asyncio.sleep(0)  # a real sleep yields to the loop, and so does this one


class PingLog(Notifier):
    """Fake of the service manager's socket: records each ping at its simulated time."""

    def __init__(self, time: SimulatedTime) -> None:
        super().__init__(None)
        self.time = time
        self.pings: list[float] = []

    def watchdog(self) -> bool:
        self.pings.append(self.time.now)
        return True

    def notify(self, *assignments: str) -> bool:
        raise AssertionError(f"the watchdog sends only pings, not {assignments!r}")


async def watch_until(
    until: float,
    alive_at: Callable[[float], bool] = lambda now: True,
    *,
    blocked: tuple[float, float] | None = None,
) -> tuple[PingLog, SimulatedTime]:
    """Runs the watchdog on simulated time up to ``until``, then cancels it.

    ``alive_at(now)`` is the daemon's health check at simulated time ``now``.
    """
    time = SimulatedTime(until)
    if blocked is not None:
        time.block(*blocked)
    log = PingLog(time)
    task = asyncio.create_task(
        run_watchdog(
            log,
            INTERVAL_S,
            alive=lambda: alive_at(time.now),
            clock=time.clock,
            sleep=time.sleep,
        )
    )
    await asyncio.wait_for(time.reached.wait(), timeout=10)
    assert not task.done(), "the watchdog runs until cancelled"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return log, time


async def test_watchdog_pings_every_half_interval() -> None:
    log, time = await watch_until(10.5)
    # The first ping at once, then one per 1.0 s.
    assert log.pings == [float(t) for t in range(11)]
    assert time.sleeps == [1.0] * 11


async def test_a_blocked_loop_stops_the_pings() -> None:
    # A stuck call holds the loop from 3.5 s to 9.5 s.
    log, _ = await watch_until(12.0, blocked=(3.5, 9.5))
    before = [t for t in log.pings if t < 3.5]
    during = [t for t in log.pings if 3.5 < t < 9.5]
    after = [t for t in log.pings if t >= 9.5]
    assert before == [0.0, 1.0, 2.0, 3.0]
    assert during == []
    assert after[0] - before[-1] >= 6.0
    # After the stall the schedule restarts from now: no burst of catch-up pings.
    assert after == [9.5, 10.5, 11.5], "pings resume once the loop turns again"


async def test_no_pings_while_the_daemon_says_it_is_not_alive(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Sick from 2.5 s to 7.5 s.
    log, _ = await watch_until(10.5, lambda now: not 2.5 <= now < 7.5)
    assert log.pings == [0.0, 1.0, 2.0, 8.0, 9.0, 10.0]
    messages = [r.getMessage() for r in caplog.records if r.name == "geofed.sdnotify"]
    assert messages == [
        "daemon reports itself not alive; withholding watchdog pings",
        "daemon alive again; watchdog pings resumed",
    ]


async def test_a_health_check_that_raises_counts_as_not_alive() -> None:
    def alive(now: float) -> bool:
        raise RuntimeError("engine state unreadable")

    # watch_until asserts that the watchdog task survives the failing check until cancelled.
    log, time = await watch_until(5.5, alive)
    assert log.pings == []
    assert time.sleeps == [1.0] * 6, "the schedule keeps ticking"


async def test_watchdog_refuses_a_non_positive_interval() -> None:
    with pytest.raises(ValueError, match="positive"):
        await run_watchdog(Notifier(None), 0)
