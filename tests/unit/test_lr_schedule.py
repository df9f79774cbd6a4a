"""The learning-rate schedule: factors by step, and setting them on a torch optimizer."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from geofed.lr_schedule import BASE_LR_KEY, apply_lr, job_step, lr_factor
from geofed.training_config import LrSchedule

CONSTANT = LrSchedule()
COSINE = LrSchedule(kind="warmup_cosine", warmup_steps=10, min_lr_ratio=0.1)
NO_WARMUP = LrSchedule(kind="warmup_cosine", warmup_steps=0, min_lr_ratio=0.0)


@pytest.mark.parametrize(
    ("schedule", "step", "total", "expected"),
    [
        (CONSTANT, 0, 100, 1.0),
        (CONSTANT, 99, 100, 1.0),
        (CONSTANT, 10_000, 100, 1.0),
        # Warm-up: linear from 1/warmup at the first step to 1 at the last warm-up step.
        (COSINE, 0, 110, 0.1),
        (COSINE, 4, 110, 0.5),
        (COSINE, 9, 110, 1.0),
        # Cosine from 1 right after the warm-up to min_lr_ratio at total_steps.
        (COSINE, 10, 110, 1.0),
        (COSINE, 60, 110, 0.1 + 0.9 * 0.5),
        (COSINE, 35, 110, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))),
        (COSINE, 110, 110, 0.1),
        # Clamped after the job's last step.
        (COSINE, 111, 110, 0.1),
        (COSINE, 5_000, 110, 0.1),
        (NO_WARMUP, 0, 100, 1.0),
        (NO_WARMUP, 50, 100, 0.5),
        (NO_WARMUP, 100, 100, 0.0),
        # A warm-up as long as the job leaves no decay: the floor right after it.
        (LrSchedule(kind="warmup_cosine", warmup_steps=4, min_lr_ratio=0.2), 3, 4, 1.0),
        (LrSchedule(kind="warmup_cosine", warmup_steps=4, min_lr_ratio=0.2), 4, 4, 0.2),
    ],
)
def test_factor_by_step(schedule: LrSchedule, step: int, total: int, expected: float) -> None:
    assert lr_factor(schedule, step, total) == pytest.approx(expected, abs=1e-12)


def test_the_cosine_decreases_monotonically_after_the_warmup() -> None:
    factors = [lr_factor(COSINE, step, 110) for step in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(factors))
    assert all(0.1 <= f <= 1.0 for f in factors)


def test_the_step_runs_over_the_whole_job() -> None:
    assert job_step(0, 50, 0) == 0
    assert job_step(3, 50, 49) == 199
    steps = [job_step(r, 5, i) for r in range(4) for i in range(5)]
    assert steps == list(range(20))


@pytest.mark.parametrize(("round_", "inner_steps", "step"), [(-1, 5, 0), (0, 0, 0), (0, 5, 5)])
def test_job_step_refuses_what_is_not_a_step(round_: int, inner_steps: int, step: int) -> None:
    with pytest.raises(ValueError, match="no step"):
        job_step(round_, inner_steps, step)


@pytest.mark.parametrize(("step", "total"), [(-1, 10), (0, 0)])
def test_factor_refuses_bad_steps(step: int, total: int) -> None:
    with pytest.raises(ValueError):
        lr_factor(COSINE, step, total)


def _optimizer() -> torch.optim.Optimizer:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    return torch.optim.AdamW([{"params": [a], "lr": 1e-3}, {"params": [b], "lr": 4e-3}])


def test_apply_sets_each_group_from_its_base_rate_without_compounding() -> None:
    optimizer = _optimizer()
    apply_lr(optimizer, 0.5)
    apply_lr(optimizer, 0.5)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([5e-4, 2e-3])
    assert [g[BASE_LR_KEY] for g in optimizer.param_groups] == [1e-3, 4e-3]
    apply_lr(optimizer, 1.0)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([1e-3, 4e-3])


def test_the_base_rate_survives_the_optimizers_state_dict() -> None:
    # A worker restarting from its regional checkpoint reloads the optimizer state, whose
    # lr is the last scheduled one; the base rate travels with it.
    trained = _optimizer()
    apply_lr(trained, 0.25)
    restarted = _optimizer()
    restarted.load_state_dict(trained.state_dict())
    apply_lr(restarted, 0.5)
    assert [g["lr"] for g in restarted.param_groups] == pytest.approx([5e-4, 2e-3])


@pytest.mark.parametrize("factor", [-0.1, float("nan"), float("inf")])
def test_apply_refuses_a_bad_factor(factor: float) -> None:
    with pytest.raises(ValueError, match="factor"):
        apply_lr(_optimizer(), factor)
