"""Each rank's part in keeping a stopped round's inner state and resuming from it.

Collectives over the group's control group: rank 0 alone reads and judges the inner
checkpoint (:mod:`regional_agent.worker.inner_checkpoint` holds its format and the pure
verdict), every rank then loads or saves its own shards, so nothing passes through rank 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from geofed.training_config import is_sharded
from regional_agent.handoff.directory import HandoffDir
from regional_agent.worker.inner_checkpoint import (
    InnerCheckpoint,
    InvalidInnerCheckpoint,
    RankInner,
    RoundIdentity,
    discard_inner_checkpoint,
    load_inner_tensors,
    read_inner_checkpoint,
    resume_verdict,
    save_inner_tensors,
    write_inner_checkpoint,
)
from regional_agent.worker.inner_loop import RankTotals
from regional_agent.worker.parallelism import ParallelModel
from regional_agent.worker.place import RankPlace

log = logging.getLogger(__name__)


def resumable_checkpoint(
    handoff: HandoffDir, identity: RoundIdentity, inner_steps: int
) -> InnerCheckpoint | None:
    """The job's inner checkpoint if it resumes this round; else discarded, saying why
    (rank 0 only)."""
    path = handoff.inner_checkpoint_path(identity.job)
    where = f"job {identity.job} round {identity.round}"
    try:
        checkpoint = read_inner_checkpoint(path)
    except (InvalidInnerCheckpoint, OSError) as exc:
        log.warning("%s: discarding the inner checkpoint: %s", where, exc)
        discard_inner_checkpoint(path)
        return None
    if checkpoint is None:
        return None
    verdict = resume_verdict(checkpoint.identity, checkpoint.step, inner_steps, identity)
    if verdict.step is None:
        log.warning("%s", verdict.reason)
        discard_inner_checkpoint(path)
        return None
    log.info("%s", verdict.reason)
    return checkpoint


def load_for_resume(
    place: RankPlace,
    identity: RoundIdentity,
    parallel: ParallelModel,
    optimizer: torch.optim.Optimizer,
    inner_steps: int,
) -> tuple[int, RankTotals] | str | None:
    """Load this rank's part of the round's inner checkpoint (collectives).

    The step to start at and this rank's totals before it; None when there is nothing to
    resume (the same answer on every rank); this rank's error when loading failed (the
    caller agrees on it with the others).
    """
    box: list[tuple[int, tuple[RankInner, ...]] | None] = [None]
    if place.rank == 0:
        checkpoint = resumable_checkpoint(place.handoff, identity, inner_steps)
        if checkpoint is not None:
            box[0] = (checkpoint.step, checkpoint.ranks)
    dist.broadcast_object_list(box, src=0, group=place.control)
    if box[0] is None:
        return None
    step, ranks = box[0]
    mine = ranks[place.rank]
    try:
        # Every rank reads its own shards: nothing passes through rank 0.
        load_inner_tensors(
            parallel.model,
            optimizer,
            place.handoff.inner_checkpoint_path(identity.job),
            place.control,
            replicated=not is_sharded(parallel.kind),
        )
        torch.set_rng_state(mine.cpu_rng)
        if place.device.type == "cuda" and mine.cuda_rng is not None:
            torch.cuda.set_rng_state(mine.cuda_rng, place.device)
    except Exception as exc:
        log.exception("cannot resume job %s round %d", identity.job, identity.round)
        return f"rank {place.rank}: cannot resume from the inner checkpoint: {exc}"
    return step, mine.totals


def keep_inner_state(
    place: RankPlace,
    agree: Callable[[bool], tuple[bool, ...]],
    identity: RoundIdentity,
    parallel: ParallelModel,
    optimizer: torch.optim.Optimizer,
    inner_steps: int,
    step: int,
    so_far: RankTotals,
) -> None:
    """Keep the state of a round stopped before ``step`` for the restart (collectives:
    every rank saves its shards, then rank 0 writes the file that names them). A failure
    is logged: the round is then trained from its start next time, as without one."""
    mine = RankInner(
        cpu_rng=torch.get_rng_state(),
        cuda_rng=torch.cuda.get_rng_state(place.device) if place.device.type == "cuda" else None,
        totals=so_far,
    )
    ranks: list[RankInner | None] = [None] * place.world_size
    dist.all_gather_object(ranks, mine, group=place.control)
    path = place.handoff.inner_checkpoint_path(identity.job)
    if place.rank == 0:
        discard_inner_checkpoint(path)  # a stale one of another round, a killed write's
    agree(False)  # nobody writes before the stale files are gone
    try:
        save_inner_tensors(
            parallel.model,
            optimizer,
            path,
            place.control,
            replicated=not is_sharded(parallel.kind),
        )
        if place.rank == 0:
            write_inner_checkpoint(
                path,
                InnerCheckpoint(
                    identity=identity,
                    step=step,
                    inner_steps=inner_steps,
                    ranks=tuple(r for r in ranks if r is not None),
                ),
            )
    except Exception:
        log.exception("job %s round %d: cannot keep the inner state", identity.job, identity.round)
        return
    if place.rank == 0:
        log.info(
            "job %s round %d: stopped before step %d of %d; kept the inner state in %s",
            identity.job,
            identity.round,
            step,
            inner_steps,
            path,
        )
