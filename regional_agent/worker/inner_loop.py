"""The inner training loop of one round on one rank: H optimizer steps from the data cursor.

Each optimizer step takes ``training.grad_accumulation`` micro-batches; each
micro-batch's loss is scaled by ``1/accumulation``. Under DDP its gradient is synchronised
only on the step's last one (``no_sync``); under FSDP every micro-batch reduce-scatters,
so the accumulated gradient stays sharded (:meth:`ParallelModel.gradient_sync`).
Before the step the learning rate is set from the schedule at the region's inner step
over the whole job (:func:`geofed.lr_schedule.job_step`), which the task also hears
(:meth:`~geofed.task.Task.on_step`); the gradient's global norm is clipped when the job
says so. The data cursor advances by one per micro-batch, and every micro-batch's tokens
count.

The loop asks ``should_stop`` before every optimizer step, so every rank stops at the
same step; a stopped round returns None, and tells ``on_stop`` the step it stopped
before and its totals so far. A round resumed after such a stop
(:mod:`regional_agent.worker.inner_checkpoint`) starts at ``plan.first_step`` with the totals
``carried`` from before, and ends with the same totals as had it never stopped.

Each rank also measures its round (:class:`RankTotals`): the loop's wall time, the time
spent waiting for batches, the gradient all-reduce time under DDP, the peak CUDA memory,
the last learning rate and the gradient norm at the last step (the clipping's own when
clipping, else computed once after that step). :func:`region_stats` combines every
rank's into the region's :class:`~regional_agent.handoff.training_stats.TrainingStats`.
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from geofed.lr_schedule import apply_lr, job_step, lr_factor
from geofed.task import DataShard, Task
from geofed.training_config import TrainingConfig
from regional_agent.handoff.messages import RoundInstruction
from regional_agent.handoff.training_stats import RankTiming, TrainingStats
from regional_agent.worker.parallelism import ParallelModel
from regional_agent.worker.precision import autocast


def data_shard(instruction: RoundInstruction, rank: int, world_size: int) -> DataShard:
    """The data ``rank`` of ``world_size`` reads for ``instruction``: fixed by the job's
    assignment (the region's place among the job's regions) and the job's seed."""
    return DataShard(
        region=instruction.region,
        region_index=instruction.region_index,
        num_regions=instruction.num_regions,
        rank=rank,
        world_size=world_size,
        seed=instruction.seed,
        datasets=dict(instruction.datasets),
        datasets_without_files=instruction.datasets_without_files,
    )


def round_seed(seed: int, round_: int, rank: int) -> int:
    """The torch seed of ``rank`` in round ``round_``: dropout etc. replay after a restart."""
    digest = hashlib.sha256(f"geofed-round/{seed}/{round_}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """What one rank trains this round."""

    round: int
    inner_steps: int
    total_steps: int
    """The job's inner steps in all, which the schedule decays over."""
    training: TrainingConfig
    first_step: int = 0
    """The step the loop starts at: those before it were trained before a stop."""


@dataclass(frozen=True, slots=True)
class RankTotals:
    """What one rank trained in a finished round."""

    micro_batches: int
    tokens: int
    loss_sum: float
    """The sum of every micro-batch's unscaled loss."""
    last_lr: float
    last_grad_norm: float
    """The gradient's global norm at the last step, before any clipping."""
    seconds: float
    """Wall time of the loop, up to the device finishing its work."""
    data_wait_seconds: float = 0.0
    """Time spent in ``next(batches)``."""
    comm_seconds: float | None = None
    """Time with a data-parallel collective in flight (None where it is not measured)."""
    peak_memory_bytes: int | None = None
    """Peak CUDA memory allocated during the round; None on the CPU."""


def train_round(
    parallel: ParallelModel,
    optimizer: torch.optim.Optimizer,
    task: Task[Any],
    batches: Iterator[Any],
    plan: RoundPlan,
    should_stop: Callable[[int], bool],
    device: torch.device,
    *,
    carried: RankTotals | None = None,
    on_stop: Callable[[int, RankTotals], None] | None = None,
) -> RankTotals | None:
    """Run the optimizer steps from ``plan.first_step`` to ``plan.inner_steps``; None when
    ``should_stop(step)`` agreed, after ``on_stop(step, totals so far)``.

    ``carried``: the totals of the steps before ``plan.first_step``; ``batches`` must
    start at that step's first micro-batch.
    """
    training = plan.training
    accumulation = training.grad_accumulation
    started = time.monotonic()
    before = carried or RankTotals(0, 0, 0.0, 0.0, math.nan, 0.0)
    parallel.module.train()
    if parallel.comm is not None:
        parallel.comm.start()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    data_wait = 0.0
    # Carried as a float64 value: the sum goes on exactly as if never interrupted.
    loss_sum = torch.tensor(before.loss_sum, dtype=torch.float64, device=device)
    tokens = before.tokens
    last_lr = before.last_lr
    grad_norm: torch.Tensor | None = None

    def comm_seconds() -> float | None:
        seconds = None if parallel.comm is None else parallel.comm.seconds()
        return None if seconds is None else seconds + (before.comm_seconds or 0.0)

    def peak_memory() -> int | None:
        if device.type != "cuda":
            return None
        return max(int(torch.cuda.max_memory_allocated(device)), before.peak_memory_bytes or 0)

    for step_in_round in range(plan.first_step, plan.inner_steps):
        if should_stop(step_in_round):
            if on_stop is not None:
                on_stop(
                    step_in_round,
                    RankTotals(
                        micro_batches=step_in_round * accumulation,
                        tokens=tokens,
                        loss_sum=float(loss_sum.item()),
                        last_lr=last_lr,
                        last_grad_norm=math.nan,
                        seconds=before.seconds + time.monotonic() - started,
                        data_wait_seconds=before.data_wait_seconds + data_wait,
                        comm_seconds=comm_seconds(),
                        peak_memory_bytes=peak_memory(),
                    ),
                )
            return None
        step = job_step(plan.round, plan.inner_steps, step_in_round)
        apply_lr(optimizer, lr_factor(training.lr_schedule, step, plan.total_steps))
        last_lr = float(optimizer.param_groups[0]["lr"])
        task.on_step(step)
        step_tokens, step_wait, clipped = _optimizer_step(
            parallel, optimizer, task, batches, training, device, loss_sum
        )
        tokens += step_tokens
        data_wait += step_wait
        grad_norm = clipped if clipped is not None else grad_norm
    loss_total = float(loss_sum.item())  # waits for the device's queued work
    seconds = before.seconds + time.monotonic() - started
    grad_norm = _last_grad_norm(parallel, optimizer, grad_norm)
    return RankTotals(
        micro_batches=plan.inner_steps * accumulation,
        tokens=tokens,
        loss_sum=loss_total,
        last_lr=last_lr,
        last_grad_norm=float(grad_norm.item()),
        seconds=seconds,
        data_wait_seconds=before.data_wait_seconds + data_wait,
        comm_seconds=comm_seconds(),
        peak_memory_bytes=peak_memory(),
    )


def _last_grad_norm(
    parallel: ParallelModel, optimizer: torch.optim.Optimizer, clipped: torch.Tensor | None
) -> torch.Tensor:
    """The last step's gradient norm (``clipped``'s, else computed now: one norm is cheap);
    the gradients are then freed, since nothing reads them past the round's last step and
    the delta's hand-over that follows is rank 0's peak."""
    norm = clipped if clipped is not None else parallel.grad_norm()
    optimizer.zero_grad(set_to_none=True)
    return norm


def region_stats(
    totals: RankTotals,
    region_tokens: int,
    steps: int,
    flops_per_token: float,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> TrainingStats:
    """The region's measurements of a round: the slowest rank's times, the largest
    rank's memory, and each rank's own times (a collective over ``group``, on the CPU)."""
    unknown = -1.0
    mine = torch.tensor(
        [
            totals.seconds,
            totals.data_wait_seconds,
            unknown if totals.comm_seconds is None else totals.comm_seconds,
            unknown if totals.peak_memory_bytes is None else float(totals.peak_memory_bytes),
            float(node_index(dist.get_rank(group))),
        ],
        dtype=torch.float64,
    )
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    hosts: list[object] = [None] * len(every)
    # The node's name as the scheduler knows it (what srun --exclude takes), else its host's.
    name = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    dist.all_gather_object(hosts, name, group=group)
    seconds, data_wait, comm, peak, _ = torch.stack(every).amax(dim=0).tolist()
    ranks = tuple(
        RankTiming(
            rank=rank,
            node=int(values[4]),
            busy_seconds=None if values[2] < 0 else max(0.0, float(values[0] - values[2])) / steps,
            data_wait_seconds=float(values[1]),
            host=str(hosts[rank]),
        )
        for rank, values in enumerate(every)
    )
    return TrainingStats(
        step_seconds=seconds / steps,
        tokens_per_second=region_tokens / seconds if seconds > 0 else 0.0,
        data_wait_seconds=data_wait,
        learning_rate=totals.last_lr,
        grad_norm=math.inf if math.isnan(totals.last_grad_norm) else totals.last_grad_norm,
        flops_per_token=flops_per_token,
        comm_seconds=None if comm < 0 else comm,
        peak_memory_bytes=None if peak < 0 else int(peak),
        accelerator=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        ranks=ranks,
    )


def node_index(rank: int) -> int:
    """The node of ``rank`` in its worker group: the ranks are numbered head node first
    (rank 0's node is 0), each node's ranks together (``LOCAL_WORLD_SIZE`` of them)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    per_node = int(raw) if raw.isdigit() and int(raw) > 0 else 1
    return rank // per_node


def _optimizer_step(
    parallel: ParallelModel,
    optimizer: torch.optim.Optimizer,
    task: Task[Any],
    batches: Iterator[Any],
    training: TrainingConfig,
    device: torch.device,
    loss_sum: torch.Tensor,
) -> tuple[int, float, torch.Tensor | None]:
    """One optimizer step over the job's micro-batches, their losses added to ``loss_sum``
    in place: the tokens seen, the seconds waited for data, and the gradient norm when
    clipping (None otherwise)."""
    accumulation = training.grad_accumulation
    tokens, data_wait = 0, 0.0
    grad_norm: torch.Tensor | None = None
    optimizer.zero_grad(set_to_none=True)
    for micro in range(accumulation):
        waited = time.monotonic()
        batch = next(batches)
        data_wait += time.monotonic() - waited
        with parallel.gradient_sync(micro == accumulation - 1):
            with autocast(training.precision, training.parallelism, device):
                loss = task.loss(parallel.module, batch)
            torch.autograd.backward(loss / accumulation)
        loss_sum += loss.detach()
        tokens += task.tokens(batch)
    if training.grad_clip_norm is not None:
        grad_norm = parallel.clip_grad_norm(float(training.grad_clip_norm))
    optimizer.step()
    return tokens, data_wait, grad_norm
