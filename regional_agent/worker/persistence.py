"""A job's state on disk between rounds, as the ranks keep it: the regional checkpoint
rank 0 reads and shares, the inner optimizer state saved (every rank its part), a parked
job's record, and the error-feedback residual rank 0 writes out before it lets it go.

Each function takes the rank's :class:`~regional_agent.worker.place.RankPlace`; those that
are collectives say so, and every rank of the group calls them alike.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from geofed.training_config import is_sharded
from regional_agent.handoff.messages import RegionalCheckpoint
from regional_agent.handoff.residual_file import ResidualWriter
from regional_agent.worker.job_state import WorkerJobState
from regional_agent.worker.optimizer_checkpoint import save_optimizer
from regional_agent.worker.parallelism import ParallelModel
from regional_agent.worker.place import RankPlace
from regional_agent.worker.residual_shards import DeviceResidual, ResidualGroup

__all__ = ["park_job", "save_job_optimizer", "shared_checkpoint", "write_out_residual"]

log = logging.getLogger(__name__)


def shared_checkpoint(place: RankPlace, job: str) -> tuple[RegionalCheckpoint | None, str | None]:
    """The job's regional checkpoint as rank 0 read it, and rank 0's error (a collective).

    Only rank 0 reads the hand-off directory: the other ranks may run on nodes that do not
    share its filesystem. Under FSDP only rank 0's optimizer state is loaded
    (:meth:`ParallelModel.load_optimizer_state`), so the others get it empty.
    """
    box: list[tuple[RegionalCheckpoint | None, str | None] | None] = [None]
    checkpoint: RegionalCheckpoint | None = None
    if place.rank == 0:
        error: str | None = None
        try:
            checkpoint = place.handoff.read_checkpoint(job)
        except Exception as exc:
            log.exception("cannot read the regional checkpoint of job %s", job)
            error = f"{type(exc).__name__}: {exc}"
        sent = checkpoint
        if sent is not None and is_sharded(sent.parallelism) and sent.optimizer_state:
            sent = replace(sent, optimizer_state={})
        box[0] = (sent, error)
    dist.broadcast_object_list(box, src=0, group=place.control)
    assert box[0] is not None
    received, error = box[0]
    return (checkpoint if place.rank == 0 else received), error


def save_job_optimizer(
    place: RankPlace,
    state: WorkerJobState,
    parallel: ParallelModel,
    optimizer: torch.optim.Optimizer,
    round_: int,
    why: str,
) -> bool:
    """Save ``state``'s optimizer state as of the end of ``round_``, every rank its part
    (a collective); False when it failed (on every rank: the checkpoint named so far
    stays)."""
    handoff = place.handoff
    started = time.monotonic()
    try:
        # Every other round's directory (an unnamed, unfinished one) goes first; the one
        # the record names stays until a newer one is named.
        handoff.remove_optimizer_states(state.job, (state.saved_optimizer_round, round_))
        save_optimizer(
            parallel.model,
            optimizer,
            handoff.optimizer_path(state.job, round_),
            place.control,
            replicated=not is_sharded(parallel.kind),
        )
    except Exception:
        log.exception(
            "job %s: cannot save the inner optimizer state of round %d", state.job, round_
        )
        return False
    state.saved_optimizer_round = round_
    log.info(
        "job %s: inner optimizer state of round %d saved in %.2f s (%s)",
        state.job,
        round_,
        time.monotonic() - started,
        why,
    )
    return True


def park_job(place: RankPlace, state: WorkerJobState, why: str) -> None:
    """Save ``state``'s optimizer state if its checkpoint holds an older one, and name it
    in the record (a collective): a parked or stopped job loses nothing."""
    parallel, optimizer = state.parallel, state.optimizer
    round_ = state.last_round
    if parallel is None or optimizer is None or round_ is None:
        return
    if state.saved_optimizer_round == round_:
        return
    if not save_job_optimizer(place, state, parallel, optimizer, round_, why):
        return
    if place.rank == 0:
        try:
            place.handoff.write_checkpoint(
                RegionalCheckpoint(
                    job=state.job,
                    last_round=round_,
                    cursor=state.cursor,
                    world_size=place.world_size,
                    parallelism=state.training.parallelism,
                    optimizer_round=round_,
                )
            )
        except OSError:
            log.exception("job %s: cannot write the regional checkpoint", state.job)


def write_out_residual(place: RankPlace, kept: DeviceResidual | None) -> DeviceResidual | None:
    """Write the residual the group holds to its job's held file, unless its tensors are
    in a file already, so that it outlives this process (a collective: rank 0 gathers
    each tensor from the ranks' slices and writes it); the residual as now held (marked
    written once it is)."""
    if kept is None or kept.written:
        return kept
    group = ResidualGroup(place.rank, place.world_size, place.device, place.control)
    path = place.handoff.held_residual_path(kept.job)
    writer: ResidualWriter | None = None
    if place.rank == 0:
        try:
            writer = ResidualWriter(path, kept.round, kept.shapes, id_=kept.id)
        except Exception:
            log.exception("job %s: cannot write out the error-feedback residual", kept.job)
    for name, shape in kept.shapes.items():
        whole = group.gather(kept.slices[name], shape)
        if writer is not None and whole is not None:
            try:
                writer.put(name, whole)
            except Exception:
                log.exception("job %s: cannot write out the error-feedback residual", kept.job)
                writer.abort()
                writer = None
    done = False
    if writer is not None:
        try:
            writer.commit()
            done = True
            log.info("job %s: wrote out the residual of round %d to %s", kept.job, kept.round, path)
        except Exception:
            log.exception("job %s: cannot write out the error-feedback residual", kept.job)
    return replace(kept, written=True) if group.broadcast(done) else kept
