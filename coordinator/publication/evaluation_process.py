"""What runs in the coordinator's evaluation process: a task's evaluation of θ, and its budget.

``Executors.evaluate`` spawns that process afresh for every coordinator (and again after
it died), and a spawned interpreter imports what the functions it runs are defined
with. So this module holds them apart from the daemon: it imports torch, the task
interface and the memory budget, not HTTP, the state store or the codec (a third of a
second less at each start).
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from coordinator.memory_budget import keep_within
from geofed.params import load_federated_state
from geofed.task import Task, load_task

__all__ = ["evaluate_in_process", "evaluate_params", "evaluation_budget"]


def evaluation_budget(max_bytes: int | None) -> None:
    """The process's initializer: end it past ``max_bytes`` of resident memory."""
    if max_bytes is not None:
        keep_within(max_bytes, "the coordinator's evaluation process", "limits.max_task_bytes")


def evaluate_params(task: Task[Any], seed: int, params: Mapping[str, Tensor]) -> dict[str, float]:
    """The task's held-out metrics (``val_loss`` at least, or none) of ``params``."""
    model = task.build_model(seed=seed)
    load_federated_state(model, params)
    model.eval()
    with torch.no_grad():
        return task.evaluate(model)


@functools.lru_cache(maxsize=4)
def _task(spec: str, options_json: str) -> Task[Any]:
    # Kept across evaluations: loading a task may read its whole corpus.
    return load_task(spec, json.loads(options_json))


def evaluate_in_process(
    spec: str, options_json: str, seed: int, params_bytes: bytes
) -> dict[str, float]:
    """:func:`evaluate_params` in the evaluation process, from picklable arguments.

    ``params_bytes`` is θ as ``torch.save`` bytes, loaded with ``weights_only``: plain
    tensors never travel through shared memory, so θ in the coordinator stays as it is.
    """
    # oneDNN builds its kernels in writable-executable memory, which the coordinator's
    # unit denies (MemoryDenyWriteExecute=yes, inherited by this process): evaluate
    # without them. This process does nothing else.
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]
    params = torch.load(io.BytesIO(params_bytes), weights_only=True)
    metrics = evaluate_params(_task(spec, options_json), seed, params)
    return {str(name): float(value) for name, value in metrics.items()}
