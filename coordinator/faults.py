"""Fault-injection points for crash tests; inert unless ``GEOFED_FAULT_PAUSE_AT`` is set.

``GEOFED_FAULT_PAUSE_AT=PHASE`` or ``PHASE:ROUND`` (read once, when the runtime loads)
makes the round driver stop for good at that phase of every round (or of round ROUND
only): it writes the marker file ``fault-<phase>-<job>-<round>`` into the state
directory and waits there, so a test can ``kill -9`` the process at a known point.
Phases:

- ``aggregate``: the round is closed (its record says aggregating) and nothing of its
  publication has been computed or written yet;
- ``publish``: the update (and the snapshot, if due) and θ_{r+1}'s working state are
  stored, but the transaction that publishes the round has not committed.

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
Phase = Literal["aggregate", "publish"]
PHASES: Final[tuple[Phase, ...]] = ("aggregate", "publish")


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
        """At an armed point: leave the marker file, then wait until the process dies."""
        if not self.active(phase, round):
            return
        marker = state_dir / f"fault-{phase}-{job}-{round}"
        await asyncio.to_thread(atomic_write_bytes, marker, b"")
        log.warning("fault injection: job %s round %d paused at %s (%s)", job, round, phase, marker)
        await asyncio.Event().wait()
