"""Fault-injection points for crash tests; inert unless ``GEOFED_FAULT_PAUSE_AT`` is set.

``GEOFED_FAULT_PAUSE_AT=PHASE`` or ``PHASE:ROUND`` (read once, when the runtime loads)
makes the round driver stop for good at that phase of every round (or of round ROUND
only): it writes the marker file ``fault-<phase>-<job>-<round>`` into the state
directory and waits there, so a test can ``kill -9`` the process at a known point.
Phases:

- ``aggregate``: the round is closed (its record says aggregating) and nothing of its
  publication has been computed or written yet;
- ``publish``: the update (and the snapshot, if due) and θ_{r+1}'s working state are
  stored, but the transaction that publishes the round has not committed;
- ``recover``: a job engine of a (re)started coordinator is about to read its job's
  working state back (its round is not known yet: ``ROUND`` is 0). This pause ends when
  the test removes the marker file, so that what the coordinator answers meanwhile can
  be checked.

Nothing else changes: requests are still served while the driver waits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from geofed.fsutil import atomic_write_bytes

__all__ = ["FAULT_ENV", "PHASES", "FaultError", "FaultPoints", "Phase"]

log = logging.getLogger(__name__)

FAULT_ENV: Final = "GEOFED_FAULT_PAUSE_AT"
Phase = Literal["aggregate", "publish", "recover"]
PHASES: Final[tuple[Phase, ...]] = ("aggregate", "publish", "recover")
#: Phases whose pause ends when the marker file is removed (the others wait for the kill).
_RELEASED_BY_MARKER: Final[frozenset[Phase]] = frozenset({"recover"})
_RELEASE_POLL_S: Final = 0.05


class FaultError(ValueError):
    """``GEOFED_FAULT_PAUSE_AT`` names no known phase or an unusable round."""


@dataclass(frozen=True, slots=True)
class FaultPoints:
    """Where the round driver pauses; the default pauses nowhere."""

    pause_at: Phase | None = None
    round: int | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> FaultPoints:
        value = environ.get(FAULT_ENV, "").strip()
        if not value:
            return cls()
        phase, _, round_text = value.partition(":")
        if phase not in PHASES:
            raise FaultError(f"{FAULT_ENV}={value!r}: the phase must be one of {', '.join(PHASES)}")
        round_: int | None = None
        if round_text:
            if not round_text.isdigit():
                raise FaultError(f"{FAULT_ENV}={value!r}: the round must be an integer >= 0")
            round_ = int(round_text)
        return cls(phase, round_)

    def active(self, phase: Phase, round: int) -> bool:
        return self.pause_at == phase and self.round in (None, round)

    async def reached(self, phase: Phase, state_dir: Path, job: str, round: int) -> None:
        """At an armed point: leave the marker file, then wait until the process dies (or,
        for ``recover``, until the marker is removed)."""
        if not self.active(phase, round):
            return
        marker = state_dir / f"fault-{phase}-{job}-{round}"
        await asyncio.to_thread(atomic_write_bytes, marker, b"")
        log.warning("fault injection: job %s round %d paused at %s (%s)", job, round, phase, marker)
        if phase not in _RELEASED_BY_MARKER:
            await asyncio.Event().wait()
        while await asyncio.to_thread(marker.exists):  # noqa: ASYNC110 - released by a file
            await asyncio.sleep(_RELEASE_POLL_S)
        log.warning("fault injection: job %s released at %s", job, phase)
