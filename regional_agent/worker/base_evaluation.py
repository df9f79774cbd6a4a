"""Evaluating the round's base parameters θ_r on the region's own accelerator.

The region already holds θ_r on its device once it was loaded for training, so it
evaluates there, before the first step, instead of the coordinator evaluating on its CPU
(:mod:`geofed.evaluation_config` decides when). Every rank runs the task's
``evaluate_region`` (on the region's own held-out data where the task has some):
under FSDP on the sharded root, whose forward all-gathers the shards, so no rank may skip
it; under DDP on the bare replica, so no collective runs. Rank 0's
metrics are the region's. The forward runs in eval mode, without gradients, in the
precision the region trains in.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from geofed.task import DataShard, Task
from geofed.training_config import TrainingConfig
from regional_agent.worker.parallelism import ParallelModel
from regional_agent.worker.precision import autocast

__all__ = ["evaluate_base"]

log = logging.getLogger(__name__)


def evaluate_base(
    task: Task[Any],
    parallel: ParallelModel,
    training: TrainingConfig,
    device: torch.device,
    shard: DataShard,
) -> dict[str, float]:
    """The task's held-out metrics of the parameters ``parallel`` holds (finite ones only),
    as the region measures them on its own data (``shard``: this rank's).

    A collective under FSDP: every rank calls it. Metrics that are not finite numbers are
    left out (a manifest carries finite numbers only) and logged.
    """
    # The DDP wrapper would broadcast buffers in its forward; the bare replica holds θ too.
    model = parallel.model if parallel.kind == "ddp" else parallel.module
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(training.precision, training.parallelism, device):
            metrics = task.evaluate_region(model, shard)
    finally:
        model.train(was_training)
    kept: dict[str, float] = {}
    for name, value in metrics.items():
        number = float(value)
        if math.isfinite(number):
            kept[str(name)] = number
        else:
            log.warning("evaluation metric %s is %s: not reported", name, number)
    return kept
