"""What a (re)started round engine finds of its job's rounds; reading it changes nothing.

The job's pointers name its working state θ_version. With it go: the digest of the update
that produced θ_version (announced with the round), when the newest checkpoint was
recorded, the arrival timings of the last ``window_rounds`` rounds (for the adaptive
deadline), the quarantine standing saved with the newest round record, and the record of
round ``version`` itself if it was opened.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coordinator.jobs.context import JobContext
from coordinator.rounds.deadline import RoundTiming
from coordinator.rounds.quarantine import Quarantine
from coordinator.rounds.records import RoundRecord
from coordinator.rounds.state import RoundPhase, RoundState
from coordinator.services import Services
from coordinator.state.store import Receipt
from coordinator.storage.checkpoints import CheckpointEntry, EntryKind
from coordinator.storage.replay import ReplayRound, replay_inputs, replay_rounds
from coordinator.storage.working_state import ParamsError, WorkingState, read_pointers

__all__ = [
    "RecoveredRounds",
    "last_update_digest",
    "load_working_state",
    "merged_receipts",
    "past_rounds",
    "rebuilt_working_state",
    "recover_rounds",
    "replayed_rounds",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveredRounds:
    """The rounds behind θ_version (see the module docstring)."""

    update_digest: str | None
    last_checkpoint_at: float | None
    history: tuple[RoundTiming, ...]  # oldest first
    quarantine: Quarantine | None  # None: no round recorded, the standing starts afresh
    record: RoundRecord | None  # round ``version``, if it was opened


def last_update_digest(entries: Sequence[CheckpointEntry], version: int) -> str | None:
    """The manifest digest of the update that produced θ_version; None for θ_0."""
    previous = [e for e in entries if e.kind is EntryKind.UPDATE and e.round == version - 1]
    return previous[0].manifest_digest if previous else None


async def recover_rounds(services: Services, ctx: JobContext, version: int) -> RecoveredRounds:
    """Read the rounds of ``ctx.job`` behind θ_version from its location and the state store."""
    location = ctx.publishing.location
    entries = await services.executors.files(location.store.entries, ctx.job)
    last = max((entry.recorded_at for entry in entries), default=None)
    history: list[RoundTiming] = []
    quarantine: Quarantine | None = None
    current: RoundRecord | None = None
    start = max(0, version - ctx.spec.deadline.window_rounds)
    for number in range(start, version + 1):
        saved = await services.db.load_round(ctx.job, number)
        if saved is None:
            continue
        record = RoundRecord.from_dict(saved.state, services.config.quarantine)
        timing = record.state.timing()
        if number < version and timing is not None:
            history.append(timing)
        quarantine = record.quarantine
        if number == version:
            current = record
    return RecoveredRounds(
        last_update_digest(entries, version), last, tuple(history), quarantine, current
    )


async def replayed_rounds(
    services: Services, ctx: JobContext, start: int, stop: int
) -> list[ReplayRound]:
    """What replaying the published rounds ``start`` .. ``stop`` - 1 takes (their deltas
    and summation order), from the state store; ``ParamsError`` if one is not published."""
    rounds = []
    quarantine = services.config.quarantine
    for number in range(start, stop):
        saved = await services.db.load_round(ctx.job, number)
        record = None if saved is None else RoundRecord.from_dict(saved.state, quarantine)
        receipts = await services.db.list_receipts(ctx.job, number)
        merged = [] if record is None else await merged_receipts(services, ctx.job, record.state)
        rounds.append(replay_inputs(number, record, receipts, merged))
    return rounds


async def merged_receipts(services: Services, job: str, state: RoundState) -> list[Receipt]:
    """The receipts of the late deltas round ``state`` merged, in its arrival order;
    ``ParamsError`` when one is gone (the round could not be summed again)."""
    found = []
    for arrival in state.merged:
        assert arrival.round is not None  # merged: a late delta names its round
        receipt = await services.db.receipt(job, arrival.round, arrival.region)
        if receipt is None:
            raise ParamsError(
                f"job {job} round {state.config.round}: the receipt of the late delta of "
                f"{arrival.region} for round {arrival.round} is gone"
            )
        found.append(receipt)
    return found


async def past_rounds(
    services: Services, job: str, version: int, reach: int
) -> dict[int, RoundState]:
    """The states of the published rounds ``reach`` behind round ``version`` (those a late
    delta may still be merged against), by number."""
    past: dict[int, RoundState] = {}
    for number in range(max(0, version - reach), version):
        saved = await services.db.load_round(job, number)
        if saved is None:
            continue
        record = RoundRecord.from_dict(saved.state, services.config.quarantine)
        if record.state.phase is RoundPhase.PUBLISHED:
            past[number] = record.state
    return past


async def load_working_state(
    services: Services, ctx: JobContext, pointers: Mapping[str, str]
) -> WorkingState:
    """θ_version's working state: the saved one, with the rounds after it replayed from
    their kept deltas (:mod:`coordinator.storage.replay`); ``ParamsError`` when it cannot
    be rebuilt exactly."""
    head = read_pointers(pointers)
    publishing = ctx.publishing
    state = await services.executors.compute(publishing.params_store.load, pointers)
    if state.version == head.version:
        return state
    rounds = await replayed_rounds(services, ctx, state.version, head.version)
    started = time.monotonic()
    state = await services.executors.compute(replay_rounds, publishing, state, rounds, head)
    log.info(
        "job %s: θ_%d rebuilt from the state saved at %d, %d round(s) replayed in %.2f s",
        ctx.job,
        head.version,
        head.saved.version,
        len(rounds),
        time.monotonic() - started,
    )
    return state


async def rebuilt_working_state(
    services: Services, ctx: JobContext, spent: WorkingState
) -> WorkingState:
    """θ_version's working state again, from storage, as after a restart, for a
    publication whose outer step (taken in ``spent``'s own tensors) failed part way;
    ``ParamsError`` when it cannot be rebuilt or is not the θ ``spent`` held."""
    pointers = await services.db.list_pointers(ctx.job)
    state = await load_working_state(services, ctx, pointers)
    if (state.version, state.params_hash) != (spent.version, spent.params_hash):
        raise ParamsError(
            f"job {ctx.job}: θ rebuilt from storage is θ_{state.version} ({state.params_hash}), "
            f"not θ_{spent.version} ({spent.params_hash})"
        )
    log.info("job %s: θ_%d rebuilt from storage for the next try", ctx.job, spent.version)
    return state
