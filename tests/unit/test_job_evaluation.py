"""What the job keeps of its evaluations: the pointers' format, the newest loss, and which
parameters the coordinator evaluates itself (in its evaluation process, never the pool)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from coordinator.jobs.initial_build import initial_parameters
from coordinator.jobs.spec import parse_job_spec
from coordinator.metrics import CoordinatorMetrics
from coordinator.publication.evaluation import (
    MAX_METRICS,
    METRICS_POINTER,
    JobEvaluation,
    format_history,
    format_metrics,
    format_val_loss,
    kept_metrics,
    newest,
    parse_history,
    parse_metrics,
    parse_val_loss,
)
from coordinator.publication.evaluation_process import evaluate_params
from coordinator.storage.working_state import WorkingState
from geofed.task import evaluates_centrally, load_task, load_task_class


@pytest.mark.parametrize(("version", "loss"), [(0, 5.25), (12, 0.1 + 0.2), (3, 1e-300)])
def test_the_loss_pointer_keeps_the_loss_exactly(version: int, loss: float) -> None:
    text = format_val_loss(version, loss)
    assert text.startswith(f"{version}:")
    assert parse_val_loss(text) == (version, loss)


def test_the_loss_pointer_format() -> None:
    assert format_val_loss(7, 2.5) == "7:2.5"
    assert parse_val_loss("7:2.5") == (7, 2.5)


def test_the_history_pointer_is_json_in_version_order() -> None:
    history = {10: 1.25, 2: 3.0, 0: 4.5}
    text = format_history(history)
    assert text == '{"0": 4.5, "2": 3.0, "10": 1.25}'
    assert parse_history(text) == history


def test_the_newest_parameters_loss_is_shown() -> None:
    assert newest(None, 0, 4.5) == (0, 4.5)
    assert newest((0, 4.5), 1, 3.0) == (1, 3.0)
    assert newest((1, 3.0), 1, 2.9) == (1, 2.9)  # the same version evaluated again


def test_an_older_evaluation_finishing_late_changes_nothing() -> None:
    assert newest((5, 2.0), 4, 2.5) is None


# -- where the loss comes from ---------------------------------------------------------

EVALUATED = "tests.support.coordinator:EvaluatedTinyTask"
JOB_SPEC = f"""\
job: tiny
task: {{spec: "{EVALUATED}", options: {{hidden: 8}}}}
regions: {{eu-west: [eu-data], us-east: [us-data]}}
rounds: 2
inner_steps: 1
checkpoint_storage: [eu-ckpt]
"""


class _Pointers:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    async def set_pointer(self, job: str, name: str, value: str) -> None:
        self.values[name] = value


class _InlineEvaluation:
    """Runs what would go to the evaluation process here; the compute pool is absent, so
    any evaluation sent there fails the test."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def evaluate(self, fn: Any, *args: Any) -> Any:
        self.calls.append(fn.__name__)
        return fn(*args)


def _evaluation(evaluation: str = "", job: str = JOB_SPEC) -> tuple[JobEvaluation, Any]:
    spec = parse_job_spec(job + evaluation, "job.yaml")
    services = SimpleNamespace(
        db=_Pointers(),
        executors=_InlineEvaluation(),
        metrics=CoordinatorMetrics(CollectorRegistry()),
    )
    ctx = SimpleNamespace(job="tiny", spec=spec)
    return JobEvaluation(cast(Any, services), cast(Any, ctx)), services


def _state(version: int) -> WorkingState:
    task = load_task(EVALUATED, {"hidden": 8})
    return dataclasses.replace(
        WorkingState.initial(initial_parameters(task, 0), {}), version=version
    )


def _count(services: Any, where: str) -> float:
    value = services.metrics.registry.get_sample_value(
        "geofed_evaluations_total", {"job": "tiny", "where": where}
    )
    return 0.0 if value is None else float(value)


async def test_a_regions_evaluation_is_recorded_as_the_coordinators_was() -> None:
    evaluation, services = _evaluation()
    evaluation.record(0, {"val_loss": 4.5, "val_bits_per_byte": 6.5})
    evaluation.record(1, {"val_loss": 3.0})
    await evaluation.finish()
    assert evaluation.history == {0: 4.5, 1: 3.0}
    assert evaluation.val_loss == (1, 3.0)
    assert parse_history(services.db.values["val_loss_history"]) == {0: 4.5, 1: 3.0}
    assert parse_val_loss(services.db.values["val_loss"]) == (1, 3.0)
    gauge = services.metrics.registry.get_sample_value(
        "geofed_global_validation_loss", {"job": "tiny"}
    )
    assert gauge == 3.0
    assert _count(services, "region") == 2
    # An older version reported late joins the history but not the job's loss.
    evaluation.record(0, {"val_loss": 4.4})
    await evaluation.finish()
    assert evaluation.history[0] == 4.4
    assert evaluation.val_loss == (1, 3.0)


async def test_by_default_the_coordinator_evaluates_only_the_last_parameters() -> None:
    evaluation, services = _evaluation()
    for version in (0, 1):
        evaluation.later(_state(version))
    await evaluation.finish()
    assert services.executors.calls == []
    evaluation.later(_state(2))
    await evaluation.finish()
    assert services.executors.calls == ["evaluate_in_process"]
    assert set(evaluation.history) == {2}
    assert _count(services, "coordinator") == 1


async def test_where_coordinator_evaluates_the_chosen_parameters_in_its_process() -> None:
    evaluation, services = _evaluation("evaluation: {where: coordinator, every: 2}\n")
    for version in (0, 1, 2):
        evaluation.later(_state(version))
    await evaluation.finish()
    assert services.executors.calls == ["evaluate_in_process"] * 2
    assert set(evaluation.history) == {0, 2}
    task = load_task(EVALUATED, {"hidden": 8})
    expected = evaluate_params(task, 0, initial_parameters(task, 0))["val_loss"]
    assert evaluation.history[0] == expected


async def test_the_parameters_are_released_once_copied_and_later_steps_change_nothing() -> None:
    evaluation, services = _evaluation("evaluation: {where: coordinator, every: 1}\n")
    state = _state(0)
    evaluation.later(state)
    await evaluation.params_released()  # what the engine awaits before its next step
    for tensor in state.params.values():
        tensor.add_(1.0)  # the next outer step, taken in θ's own tensors
    await evaluation.finish()
    task = load_task(EVALUATED, {"hidden": 8})
    expected = evaluate_params(task, 0, initial_parameters(task, 0))["val_loss"]
    assert evaluation.history == {0: expected}
    assert services.executors.calls == ["evaluate_in_process"]
    await evaluation.params_released()  # nothing under way: returns at once


async def test_nobody_evaluates_under_where_none() -> None:
    evaluation, services = _evaluation("evaluation: {where: none}\n")
    evaluation.later(_state(2))
    await evaluation.finish()
    assert services.executors.calls == []
    assert evaluation.history == {}


async def test_every_metric_of_the_newest_evaluation_is_kept_shown_and_restored() -> None:
    evaluation, services = _evaluation()
    evaluation.record(1, {"val_loss": 3.0, "accuracy": 0.5, "bad name!": 1.0, "nan": math.nan})
    evaluation.record(0, {"val_loss": 4.0, "accuracy": 0.25})  # older, reported late
    await evaluation.finish()
    assert evaluation.metrics == (1, {"accuracy": 0.5, "val_loss": 3.0})
    assert parse_metrics(services.db.values[METRICS_POINTER]) == evaluation.metrics
    sample = services.metrics.registry.get_sample_value
    labels = {"job": "tiny", "metric": "accuracy"}
    assert sample("geofed_global_evaluation_metric", labels) == 0.5
    assert sample("geofed_global_evaluation_metric", {**labels, "metric": "bad name!"}) is None
    # A metric-only evaluation (no val_loss) is kept too; the loss stays as it was.
    evaluation.record(2, {"accuracy": 0.75})
    await evaluation.finish()
    assert evaluation.metrics == (2, {"accuracy": 0.75})
    assert evaluation.val_loss == (1, 3.0)
    restored, _ = _evaluation()
    restored.restore(services.db.values)
    assert restored.metrics == (2, {"accuracy": 0.75})
    assert format_metrics(2, {"b": 1.0, "a": 2.0}) == '{"round": 2, "values": {"a": 2.0, "b": 1.0}}'


def test_a_task_reporting_many_metrics_keeps_the_first_in_name_order() -> None:
    many = {f"m{i:03d}": float(i) for i in range(100)}
    kept = kept_metrics(many)
    assert len(kept) == MAX_METRICS
    assert list(kept) == [f"m{i:03d}" for i in range(MAX_METRICS)]


async def test_a_task_that_measures_only_on_region_data_is_not_evaluated_here() -> None:
    assert evaluates_centrally(load_task_class(EVALUATED))
    assert not evaluates_centrally(load_task_class("geofed.tasks.hf:CausalLMTask"))
    plain = JOB_SPEC.replace(EVALUATED, "tests.support.tiny_task:TinyTask").replace(
        "options: {hidden: 8}", "options: {}"
    )
    evaluation, services = _evaluation("evaluation: {where: coordinator, every: 1}\n", plain)
    evaluation.later(_state(0))
    await evaluation.finish()
    # No evaluation process was asked to build a model that would measure nothing.
    assert services.executors.calls == []
