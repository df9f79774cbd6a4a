"""Rebuilding θ_version's working state from the saved one and the rounds after it.

The coordinator saves its working state (θ, the outer optimizer state, the residual)
only every ``working_state_every`` rounds and with each snapshot
(:func:`coordinator.publication.snapshot_policy.decide_state_save`); the rounds in between keep
their accepted deltas in the blob store. A restarted coordinator (or a standby taking
over) loads the saved state and takes each later round's outer step again, from the
same deltas summed in the same recorded order
(:func:`coordinator.aggregation.outer_round.round_step`,
the very step publication took), so it reaches the same bits; θ's hash is checked
against the one recorded when the last round was published. Nothing is stored: the
updates of those rounds are in the chain already. Blocking: run it in a worker thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from coordinator.aggregation.outer_round import (
    DeltaSource,
    JobPublishing,
    delta_sources,
    round_step,
)
from coordinator.rounds.records import RoundRecord
from coordinator.rounds.state import RoundPhase
from coordinator.state.store import Receipt
from coordinator.storage.working_state import ParamsError, SavedPointers, WorkingState
from geofed.blobstore import BlobStoreError
from geofed.codec import CodecError
from geofed.params import parameters_vector_hash

__all__ = ["ReplayRound", "replay_inputs", "replay_rounds"]


@dataclass(frozen=True, slots=True)
class ReplayRound:
    """A published round to take again: its accepted deltas and the order they summed in."""

    round: int
    sources: tuple[DeltaSource, ...]
    order: tuple[str, ...]

    @property
    def digests(self) -> tuple[str, ...]:
        return tuple(source.blob_digest for source in self.sources)


def replay_inputs(
    round_: int,
    record: RoundRecord | None,
    receipts: Iterable[Receipt],
    merged: Iterable[Receipt] = (),
) -> ReplayRound:
    """What replaying published round ``round_`` needs, from its stored record, its
    receipts and those of the late deltas it ``merged``; :class:`ParamsError` when the
    record is missing or not published."""
    if record is None or record.state.phase is not RoundPhase.PUBLISHED:
        raise ParamsError(f"round {round_} has no published record to replay")
    summed = record.state.summed
    sources = tuple(delta_sources(receipts, record.state.included, merged, round_))
    if sorted(s.key for s in sources) != sorted(summed):
        raise ParamsError(
            f"round {round_}: receipts of {sorted(s.key for s in sources)}, "
            f"but the round summed {sorted(summed)}"
        )
    return ReplayRound(round_, sources, summed)


def replay_rounds(
    job: JobPublishing, state: WorkingState, rounds: Sequence[ReplayRound], head: SavedPointers
) -> WorkingState:
    """θ_{head.version}'s working state: ``state`` (the saved one) with ``rounds`` taken
    again in order; :class:`ParamsError` when a delta is gone or θ's hash differs."""
    expected = list(range(state.version, head.version))
    if [r.round for r in rounds] != expected:
        raise ParamsError(
            f"job {job.job}: replaying rounds {[r.round for r in rounds]}, not {expected}"
        )
    for replayed in rounds:
        try:
            # The state loaded for the replay is its own: each round steps in its tensors.
            step, _ = round_step(job, state, replayed.sources, order=replayed.order, in_place=True)
        except (BlobStoreError, CodecError) as exc:
            raise ParamsError(
                f"job {job.job}: round {replayed.round} cannot be replayed: a delta it "
                f"summed is unusable ({exc})"
            ) from None
        state = WorkingState(
            version=replayed.round + 1,
            params=step.params,
            params_hash="",
            optimizer_state=step.optimizer_state,
            residual=step.residual,
            saved=state.saved,
        )
    found = parameters_vector_hash(state.params)
    if found != head.params_hash:
        raise ParamsError(
            f"job {job.job}: θ_{head.version} replayed from the state saved at "
            f"{head.saved.version} hashes to {found}, not the recorded {head.params_hash}"
        )
    return WorkingState(
        state.version, state.params, found, state.optimizer_state, state.residual, head.saved
    )
