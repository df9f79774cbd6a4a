"""What a finished round leaves in the hand-off directory: its summary and the job's
regional checkpoint record (rank 0), written in the order that publishes them."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from regional_agent.handoff.delta_stream import WrittenDelta
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.messages import RegionalCheckpoint, RoundInstruction, RoundSummary
from regional_agent.handoff.training_stats import TrainingStats
from regional_agent.worker.delayed_round import DelayedFold
from regional_agent.worker.inner_checkpoint import discard_inner_checkpoint
from regional_agent.worker.inner_loop import RankTotals
from regional_agent.worker.job_state import WorkerJobState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TrainedRound:
    """A round's inner loop, finished: this rank's totals and when it ran."""

    totals: RankTotals
    started: float  # time.monotonic()
    started_at: float  # the wall clock
    finished_at: float


@dataclass(frozen=True, slots=True)
class RegionTotals:
    """The region's figures of a round, summed over the ranks."""

    tokens: int
    mean_loss: float
    cursor: int
    stats: TrainingStats | None


def round_records(
    instruction: RoundInstruction,
    state: WorkerJobState,
    trained: TrainedRound,
    region: RegionTotals,
    *,
    base_hash: str,
    params_hash: str,
    world_size: int,
    base_eval: dict[str, float] | None,
    fold: DelayedFold | None,
) -> tuple[RoundSummary, RegionalCheckpoint]:
    """The round's summary and the job's regional checkpoint record after it."""
    summary = RoundSummary(
        job=instruction.job,
        round=instruction.round,
        steps=instruction.inner_steps,
        tokens=region.tokens,
        mean_loss=region.mean_loss,
        cursor=region.cursor,
        base_params_hash=base_hash,
        params_hash=params_hash,
        world_size=world_size,
        train_seconds=time.monotonic() - trained.started,
        base_eval=base_eval,
        stats=region.stats,
        train_started_at=trained.started_at,
        train_finished_at=trained.finished_at,
        base_wait_seconds=None if fold is None else fold.wait_seconds,
        base_folded_at_step=None if fold is None else fold.folded_at_step,
    )
    checkpoint = RegionalCheckpoint(
        job=instruction.job,
        last_round=instruction.round,
        cursor=region.cursor,
        world_size=world_size,
        parallelism=state.training.parallelism,
        optimizer_round=state.saved_optimizer_round,
    )
    return summary, checkpoint


def publish_round(
    handoff: HandoffDir,
    summary: RoundSummary,
    params: Mapping[str, torch.Tensor] | None,
    checkpoint: RegionalCheckpoint,
    totals: RankTotals,
    delta: WrittenDelta | None = None,
) -> None:
    """Write the round's result, the regional checkpoint record and the done marker."""
    # Order matters: result (its residual file before it), then checkpoint, then the
    # marker that publishes both. The inner checkpoint goes before the marker: once the
    # marker is there the worker touches none of the round's files (a stop in between
    # trains the round again from its start, to the same result).
    handoff.write_result(summary, params, delta)
    handoff.write_checkpoint(checkpoint)
    discard_inner_checkpoint(handoff.inner_checkpoint_path(summary.job))
    handoff.write_done(summary)
    log.info(
        "job %s round %d: %d steps, %d tokens, mean loss %.4f, lr %.3g, grad norm %.3g, params %s",
        summary.job,
        summary.round,
        summary.steps,
        summary.tokens,
        summary.mean_loss,
        totals.last_lr,
        totals.last_grad_norm,
        summary.params_hash,
    )
