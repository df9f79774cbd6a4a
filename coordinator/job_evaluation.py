"""Held-out evaluation of a job's global parameters, in the background, with its own task.

:func:`evaluate_params` runs the task's ``evaluate()`` on a fresh model holding θ: CPU work
of bounded cost (the task fixes its validation split), run in a worker thread.
:class:`JobEvaluation` runs it on θ_0 (what training is measured against) and after each
published round, as background tasks the round engine never waits for, except for the
last parameters' (the job's result). It keeps the validation loss of the newest
parameters evaluated and the history of all, and persists both as pointers of the job
(:data:`VAL_LOSS_POINTER`, :data:`VAL_HISTORY_POINTER`) so that a restart shows them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any, Final

import torch
from torch import Tensor

from coordinator.context import JobContext
from coordinator.services import Services
from coordinator.working_state import WorkingState
from geofed.task import Task

__all__ = [
    "FINAL_EVALUATION_WAIT_S",
    "VAL_HISTORY_POINTER",
    "VAL_LOSS_POINTER",
    "JobEvaluation",
    "evaluate_params",
    "format_history",
    "format_val_loss",
    "newest",
    "parse_history",
    "parse_val_loss",
]

log = logging.getLogger(__name__)

VAL_LOSS_POINTER: Final = "val_loss"
VAL_HISTORY_POINTER: Final = "val_loss_history"
#: How long a finished job waits for the evaluation of its last parameters.
FINAL_EVALUATION_WAIT_S: Final = 600.0


def evaluate_params(task: Task[Any], seed: int, params: Mapping[str, Tensor]) -> dict[str, float]:
    """The task's held-out metrics (``val_loss`` at least, or none) of ``params``."""
    model = task.build_model(seed=seed)
    model.load_state_dict(dict(params))
    model.eval()
    with torch.no_grad():
        return task.evaluate(model)


def format_val_loss(version: int, loss: float) -> str:
    """The :data:`VAL_LOSS_POINTER` value: ``version:loss``, the loss exact."""
    return f"{version}:{float(loss)!r}"


def parse_val_loss(text: str) -> tuple[int, float]:
    """(version, loss) from a :data:`VAL_LOSS_POINTER` value."""
    round_text, _, value = text.partition(":")
    return int(round_text), float(value)


def format_history(history: Mapping[int, float]) -> str:
    """The :data:`VAL_HISTORY_POINTER` value: a JSON object of version to loss."""
    return json.dumps({str(k): v for k, v in sorted(history.items())})


def parse_history(text: str) -> dict[int, float]:
    """Version to loss, from a :data:`VAL_HISTORY_POINTER` value."""
    return {int(k): float(v) for k, v in json.loads(text).items()}


def newest(
    current: tuple[int, float] | None, version: int, loss: float
) -> tuple[int, float] | None:
    """The job's loss once θ_version's evaluation gave ``loss``; None to keep ``current``.

    Evaluations may finish out of order; the job shows the newest parameters' loss.
    """
    if current is not None and current[0] > version:
        return None
    return version, float(loss)


class JobEvaluation:
    """Evaluates one job's parameters in the background; holds its validation losses."""

    def __init__(self, services: Services, ctx: JobContext) -> None:
        self._s = services
        self._ctx = ctx
        #: The newest evaluated (version, validation loss), if any.
        self.val_loss: tuple[int, float] | None = None
        #: The validation loss of every evaluated version.
        self.history: dict[int, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def restore(self, pointers: Mapping[str, str]) -> None:
        """Take back the losses a previous run persisted in the job's pointers."""
        loss = pointers.get(VAL_LOSS_POINTER)
        if loss:
            self.val_loss = parse_val_loss(loss)
            self._gauge(self.val_loss[1])
        history = pointers.get(VAL_HISTORY_POINTER)
        if history:
            self.history = parse_history(history)

    def later(self, state: WorkingState) -> None:
        """Evaluate θ_version of ``state`` in the background."""
        task = asyncio.create_task(
            self._evaluate(state), name=f"evaluate-{self._ctx.job}-{state.version}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def finish(self, timeout_s: float = FINAL_EVALUATION_WAIT_S) -> None:
        """Let the evaluations under way finish (the last one is the job's result)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    async def stop(self) -> None:
        """Cancel the evaluations under way and wait until they ended."""
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _evaluate(self, state: WorkingState) -> None:
        job = self._ctx.job
        try:
            metrics = await self._s.executors.compute(
                evaluate_params, self._ctx.task, self._ctx.spec.seed, state.params
            )
        except Exception:
            log.exception("job %s: evaluating θ_%d failed", job, state.version)
            return
        loss = metrics.get("val_loss")
        if loss is None:
            return
        self.history[state.version] = float(loss)
        await self._s.db.set_pointer(job, VAL_HISTORY_POINTER, format_history(self.history))
        val_loss = newest(self.val_loss, state.version, loss)
        if val_loss is None:
            return
        self.val_loss = val_loss
        self._gauge(val_loss[1])
        await self._s.db.set_pointer(job, VAL_LOSS_POINTER, format_val_loss(*val_loss))

    def _gauge(self, loss: float) -> None:
        self._s.metrics.global_validation_loss.labels(job=self._ctx.job).set(loss)
