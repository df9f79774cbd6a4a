"""The published rounds a late delta may still be merged against, kept at hand.

A job that merges late deltas (``aggregation.late: merge``) judges a delta for an
earlier round r against r's record (its participants, whom it included, θ_r's hash:
:func:`coordinator.rounds.state.judge_delta`). The round engine keeps the last
``max_staleness`` published rounds' states here, so that judging one never waits on the
state store: it adds each round it publishes, and a restarted engine reads them back
(:func:`coordinator.jobs.recovery.past_rounds`).
"""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.rounds.state import JobIntake, RoundState

__all__ = ["PastRounds"]


class PastRounds:
    """The published round states within ``reach`` of the current round (0: none kept)."""

    def __init__(self, reach: int) -> None:
        self.reach = reach
        self._states: dict[int, RoundState] = {}

    def restore(self, states: Mapping[int, RoundState]) -> None:
        """Take the states read back from the store (a restart)."""
        self._states = dict(states)

    def remember(self, state: RoundState) -> None:
        """Keep a round just published, and forget those now out of reach."""
        if not self.reach:
            return
        number = state.config.round
        self._states[number] = state
        for old in [n for n in self._states if n <= number - self.reach]:
            del self._states[old]

    def intake(self, job: str, version: int, stopped: str) -> JobIntake:
        """The job's side of judging a delta, these rounds included."""
        return JobIntake(job, version, stopped, self.reach, dict(self._states))

    def received(self, current: RoundState) -> set[tuple[str, int]]:
        """The (region, round) deltas at hand: those these rounds included, and the late
        ones ``current`` merged."""
        found = {(region, n) for n, state in self._states.items() for region in state.included}
        found.update((a.region, a.round) for a in current.merged if a.round is not None)
        return found

    def base_hash(self, round: int) -> str | None:
        """θ_round's hash as round ``round`` recorded it; None when not at hand."""
        state = self._states.get(round)
        return state.config.base_hash if state is not None else None
