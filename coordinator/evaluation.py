"""Held-out evaluation of the global parameters, with the job's own task.

Runs the task's ``evaluate()`` on a fresh model holding θ: CPU work of bounded cost (the
task fixes its validation split), run in a worker thread after each published round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from geofed.task import Task

__all__ = ["evaluate_params"]


def evaluate_params(task: Task[Any], seed: int, params: Mapping[str, Tensor]) -> dict[str, float]:
    """The task's held-out metrics (``val_loss`` at least, or none) of ``params``."""
    model = task.build_model(seed=seed)
    model.load_state_dict(dict(params))
    model.eval()
    with torch.no_grad():
        return task.evaluate(model)
