"""The held-out evaluation of a job's global parameters: recorded from regions, or run here.

Where θ_r is evaluated is the job's ``evaluation`` section
(:mod:`geofed.evaluation_config`). By default a region evaluates θ_r on its accelerator
before it trains round r, and its delta's manifest carries the metrics (``base_eval``):
:meth:`JobEvaluation.record` takes them when the delta is accepted. The coordinator
evaluates the parameters :func:`~geofed.evaluation_config.coordinator_evaluates` gives it
(every chosen θ under ``where: coordinator``, and always the job's last θ, which is the
base of no round) with :meth:`JobEvaluation.later`:
:func:`~coordinator.publication.evaluation_process.evaluate_in_process` runs the
task's ``evaluate()`` on a fresh model in the coordinator's evaluation process
(``Executors.evaluate``), never in the compute pool that aggregates, as a background
task the round engine waits for only at the job's end (the last θ's loss is the job's
result). Either way :class:`JobEvaluation` keeps the validation loss of the newest
parameters evaluated and the history of all, persists both as pointers of the job
(:data:`VAL_LOSS_POINTER`, :data:`VAL_HISTORY_POINTER`) so that a restart shows them, and
counts each evaluation in ``geofed_evaluations_total{where}``.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import re
from collections.abc import Coroutine, Mapping
from typing import Any, Final, Literal

import torch
from torch import Tensor

from coordinator.jobs.context import JobContext
from coordinator.publication.evaluation_process import evaluate_in_process
from coordinator.services import Services
from coordinator.storage.working_state import WorkingState
from geofed.evaluation_config import coordinator_evaluates
from geofed.task import evaluates_centrally, load_task_class

__all__ = [
    "FINAL_EVALUATION_WAIT_S",
    "MAX_METRICS",
    "METRICS_POINTER",
    "VAL_HISTORY_POINTER",
    "VAL_LOSS_POINTER",
    "JobEvaluation",
    "format_history",
    "format_metrics",
    "format_val_loss",
    "kept_metrics",
    "newest",
    "parse_history",
    "parse_metrics",
    "parse_val_loss",
]

log = logging.getLogger(__name__)

VAL_LOSS_POINTER: Final = "val_loss"
VAL_HISTORY_POINTER: Final = "val_loss_history"
#: Every metric of the newest evaluated parameters: ``{"round", "values"}`` as JSON.
METRICS_POINTER: Final = "eval_metrics"
#: At most this many of a task's metrics are kept, each name of this form: the gauge's
#: label values stay few and printable whatever a task or a region reports.
MAX_METRICS: Final = 32
_METRIC_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,63}")
#: How long a finished job waits for the evaluation of its last parameters.
FINAL_EVALUATION_WAIT_S: Final = 600.0


def _params_bytes(params: Mapping[str, Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(dict(params), buffer)
    return buffer.getvalue()


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


def kept_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The metrics a job keeps of an evaluation: finite numbers under plain names, the
    first :data:`MAX_METRICS` in name order."""
    kept = {
        name: float(value)
        for name, value in sorted(metrics.items())
        if _METRIC_NAME.fullmatch(name) and math.isfinite(float(value))
    }
    return dict(list(kept.items())[:MAX_METRICS])


def format_metrics(version: int, metrics: Mapping[str, float]) -> str:
    """The :data:`METRICS_POINTER` value."""
    return json.dumps({"round": version, "values": dict(sorted(metrics.items()))})


def parse_metrics(text: str) -> tuple[int, dict[str, float]]:
    """(version, metrics) from a :data:`METRICS_POINTER` value."""
    body = json.loads(text)
    return int(body["round"]), {str(k): float(v) for k, v in body["values"].items()}


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
        #: The validation loss of every evaluated version (one dict for the job's life:
        #: the snapshot policy reads it live).
        self.history: dict[int, float] = {}
        #: Every metric of the newest evaluated version (:func:`kept_metrics`), if any.
        self.metrics: tuple[int, dict[str, float]] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: Versions the coordinator is evaluating now.
        self._evaluating: set[int] = set()
        #: Copies of a state's parameters under way (the evaluation's own).
        self._copies: set[asyncio.Future[bytes]] = set()

    def restore(self, pointers: Mapping[str, str]) -> None:
        """Take back the losses a previous run persisted in the job's pointers."""
        loss = pointers.get(VAL_LOSS_POINTER)
        if loss:
            self.val_loss = parse_val_loss(loss)
            self._gauge(self.val_loss[1])
        history = pointers.get(VAL_HISTORY_POINTER)
        if history:
            self.history.clear()
            self.history.update(parse_history(history))
        metrics = pointers.get(METRICS_POINTER)
        if metrics:
            self.metrics = parse_metrics(metrics)
            self._metric_gauges(self.metrics[1])

    def later(self, state: WorkingState) -> None:
        """Evaluate θ_version of ``state`` in the background, if the coordinator should."""
        spec = self._ctx.spec
        decision = coordinator_evaluates(spec.evaluation, state.version, spec.rounds)
        if not decision.evaluate:
            log.debug("job %s: θ_%d: %s", self._ctx.job, state.version, decision.reason)
            return
        if not evaluates_centrally(load_task_class(spec.task.spec)):
            # Its metrics come from the regions' own data: nothing to measure here.
            log.debug(
                "job %s: θ_%d: the task evaluates on region data only", self._ctx.job, state.version
            )
            return
        self._evaluating.add(state.version)
        # Copied at once, so that the next publication (taken in these very tensors) can
        # wait for it: :meth:`params_released`.
        copy = asyncio.ensure_future(asyncio.to_thread(_params_bytes, state.params))
        self._copies.add(copy)
        copy.add_done_callback(self._copies.discard)
        self._background(
            self._evaluate(state.version, copy), f"evaluate-{self._ctx.job}-{state.version}"
        )

    async def params_released(self) -> None:
        """Wait until no evaluation still copies a state's parameters."""
        if self._copies:
            await asyncio.wait(set(self._copies))

    def ensure(self, state: WorkingState) -> None:
        """Evaluate θ_version of ``state`` unless it was or is being evaluated: the last
        parameters of a job whose coordinator was killed before their evaluation was kept."""
        if state.version not in self.history and state.version not in self._evaluating:
            self.later(state)

    def record(self, version: int, metrics: Mapping[str, float]) -> None:
        """Take a region's evaluation of θ_version (persisted in the background)."""
        self._background(
            self._keep(version, metrics, "region"), f"record-{self._ctx.job}-{version}"
        )

    def _background(self, coroutine: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coroutine, name=name)
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

    async def _evaluate(self, version: int, copy: asyncio.Future[bytes]) -> None:
        job, spec = self._ctx.job, self._ctx.spec
        options = json.dumps(spec.task.options, sort_keys=True)
        try:
            try:
                params = await copy
                metrics = await self._s.executors.evaluate(
                    evaluate_in_process, spec.task.spec, options, spec.seed, params
                )
            except Exception:
                log.exception("job %s: evaluating θ_%d failed", job, version)
                return
            await self._keep(version, metrics, "coordinator")
        finally:
            self._evaluating.discard(version)

    async def _keep(
        self,
        version: int,
        metrics: Mapping[str, float],
        where: Literal["region", "coordinator"],
    ) -> None:
        job = self._ctx.job
        self._s.metrics.evaluations.labels(job=job, where=where).inc()
        await self._keep_metrics(version, kept_metrics(metrics))
        loss = metrics.get("val_loss")
        if loss is None:
            return
        # The latest report of a version wins: regions evaluate the same θ on the same split.
        # What the API shows changes at once and together; persisting follows.
        self.history[version] = float(loss)
        val_loss = newest(self.val_loss, version, loss)
        if val_loss is not None:
            self.val_loss = val_loss
            self._gauge(val_loss[1])
        await self._s.db.set_pointer(job, VAL_HISTORY_POINTER, format_history(self.history))
        if val_loss is not None:
            await self._s.db.set_pointer(job, VAL_LOSS_POINTER, format_val_loss(*val_loss))

    async def _keep_metrics(self, version: int, metrics: dict[str, float]) -> None:
        """The newest version's metrics replace the ones shown (an older version's
        evaluation finishing late changes nothing)."""
        if not metrics or (self.metrics is not None and self.metrics[0] > version):
            return
        self.metrics = (version, metrics)
        self._metric_gauges(metrics)
        await self._s.db.set_pointer(
            self._ctx.job, METRICS_POINTER, format_metrics(version, metrics)
        )

    def _metric_gauges(self, metrics: Mapping[str, float]) -> None:
        gauge = self._s.metrics.global_evaluation_metric
        for name, value in metrics.items():
            gauge.labels(job=self._ctx.job, metric=name).set(value)

    def _gauge(self, loss: float) -> None:
        self._s.metrics.global_validation_loss.labels(job=self._ctx.job).set(loss)
