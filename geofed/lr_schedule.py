"""The learning-rate schedule: a factor on the optimizer's base learning rate, by step.

The step is the region's inner step over the whole job, ``round x H + step in round``
(:func:`job_step`), so the schedule continues across rounds, and a round trained again
(after a worker restart or a coordinator rollback) sees exactly the rates it saw the first
time. :func:`lr_factor` is pure; :func:`apply_lr` sets a torch optimizer's rates from it
and keeps each group's base rate in the group (``initial_lr``), so applying it twice, or
after reloading the optimizer's state, never compounds.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from geofed.training_config import LrSchedule

if TYPE_CHECKING:
    from torch.optim import Optimizer

__all__ = ["BASE_LR_KEY", "apply_lr", "job_step", "lr_factor"]

#: The param-group key holding a group's base learning rate (torch's own LR schedulers
#: use the same key, so an optimizer state saved by either reads the same).
BASE_LR_KEY = "initial_lr"


def job_step(round_: int, inner_steps: int, step_in_round: int) -> int:
    """The region's inner step over the whole job: ``round_ x inner_steps + step_in_round``."""
    if round_ < 0 or inner_steps < 1 or not 0 <= step_in_round < inner_steps:
        raise ValueError(
            f"no step {step_in_round} of round {round_} with {inner_steps} steps a round"
        )
    return round_ * inner_steps + step_in_round


def lr_factor(schedule: LrSchedule, step: int, total_steps: int) -> float:
    """The multiplier on the base learning rate for the step numbered ``step`` (from 0).

    ``constant``: 1. ``warmup_cosine``: ``(step + 1) / warmup_steps`` during the warm-up
    (the first step trains at a small rate, the last warm-up step at the full one), then
    half a cosine from 1 down to ``min_lr_ratio`` at ``total_steps``; clamped there after.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if schedule.kind == "constant":
        return 1.0
    if schedule.kind == "warmup_cosine":
        return _warmup_cosine(schedule, step, total_steps)
    raise ValueError(f"unknown learning-rate schedule {schedule.kind!r}")


def _warmup_cosine(schedule: LrSchedule, step: int, total_steps: int) -> float:
    warmup = schedule.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = total_steps - warmup
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - warmup) / decay_steps)
    floor = schedule.min_lr_ratio
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def apply_lr(optimizer: Optimizer, factor: float) -> None:
    """Set every param group's ``lr`` to its base rate times ``factor``.

    A group's base rate is its ``lr`` when first seen, kept under :data:`BASE_LR_KEY`.
    """
    if not (math.isfinite(factor) and factor >= 0):
        raise ValueError(f"learning-rate factor must be finite and >= 0, got {factor!r}")
    for group in optimizer.param_groups:
        base = group.setdefault(BASE_LR_KEY, group["lr"])
        group["lr"] = base * factor
