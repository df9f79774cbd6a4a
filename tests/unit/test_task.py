"""The Task API: DataShard validation, spec parsing, and load_task's errors."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from geofed.task import (
    DEFAULT_TASK_MODULES,
    DataShard,
    Task,
    TaskOptionsError,
    TaskSpecError,
    load_task,
    load_task_class,
    parse_task_spec,
    task_module_refusal,
    validate_module_pattern,
)
from geofed.types import InvalidName

_counter = itertools.count()


class PlainTask(Task[int]):
    """A minimal concrete task without options."""

    def build_model(self, seed: int | None = None) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0 if seed is None else seed)
            return nn.Linear(2, 1)

    def batches(self, shard: DataShard, start_step: int = 0) -> Iterator[int]:
        return itertools.count(start_step)

    def loss(self, model: nn.Module, batch: int) -> torch.Tensor:
        out: torch.Tensor = model(torch.full((1, 2), float(batch))).sum()
        return out

    def tokens(self, batch: int) -> int:
        return 1


class ScaledOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scale: float = 1.0
    width: int = 2


class ScaledTask(PlainTask):
    """A concrete task that declares options."""

    Options = ScaledOptions

    def __init__(self, options: ScaledOptions) -> None:
        self.options = options


class HalfDoneTask(Task[int]):
    """Abstract: implements only build_model."""

    def build_model(self, seed: int | None = None) -> nn.Module:
        return nn.Linear(1, 1)


class NotATask:
    pass


class BadOptionsTask(PlainTask):
    Options = dict  # type: ignore[assignment]


def not_a_class() -> None:
    pass


def _write_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> str:
    name = f"geofed_test_taskmod_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_data_shard_accepts_valid_fields() -> None:
    shard = DataShard("eu-west", 1, 3, 0, 2, 7)
    assert (shard.region_index, shard.rank, shard.seed) == (1, 0, 7)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (("eu-west", 3, 3, 0, 2, 0), "region_index"),
        (("eu-west", -1, 3, 0, 2, 0), "region_index"),
        (("eu-west", 0, 0, 0, 2, 0), "num_regions"),
        (("eu-west", 0, 3, 2, 2, 0), "rank"),
        (("eu-west", 0, 3, 0, 0, 0), "world_size"),
    ],
)
def test_data_shard_rejects_out_of_range(
    fields: tuple[str, int, int, int, int, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        DataShard(*fields)


def test_data_shard_rejects_bad_region_name() -> None:
    with pytest.raises(InvalidName, match="region"):
        DataShard("EU West", 0, 1, 0, 1, 0)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("pkg.mod:Name", ("pkg.mod", "Name")),
        ("mod:Outer.Inner", ("mod", "Outer.Inner")),
        ("_a.b_2:C_3", ("_a.b_2", "C_3")),
    ],
)
def test_parse_task_spec(spec: str, expected: tuple[str, str]) -> None:
    assert parse_task_spec(spec) == expected


@pytest.mark.parametrize(
    "spec", ["", "pkg.mod", "pkg.mod:", ":Name", "a:b:c", "a b:C", "1pkg:C", "pkg:C-D", "pkg..m:C"]
)
def test_parse_task_spec_rejects_malformed(spec: str) -> None:
    with pytest.raises(TaskSpecError, match=r"expected 'package\.module:ClassName'"):
        parse_task_spec(spec)


def test_load_task_without_options() -> None:
    task = load_task(f"{__name__}:PlainTask", {})
    assert type(task) is PlainTask
    assert type(load_task(f"{__name__}:PlainTask")) is PlainTask


def test_load_task_validates_and_passes_options() -> None:
    task = load_task(f"{__name__}:ScaledTask", {"scale": "2.5"})
    assert isinstance(task, ScaledTask)
    assert task.options == ScaledOptions(scale=2.5, width=2)


def test_load_task_missing_module() -> None:
    with pytest.raises(TaskSpecError, match="no module named 'geofed_no_such_pkg'"):
        load_task("geofed_no_such_pkg.sub:Task", {})


def test_load_task_missing_submodule() -> None:
    with pytest.raises(TaskSpecError, match=r"no module named 'geofed\.examples\.nope'"):
        load_task("geofed.examples.nope:Task", {})


def test_load_task_missing_attribute() -> None:
    with pytest.raises(TaskSpecError, match=r"has no attribute 'Missing'"):
        load_task(f"{__name__}:Missing", {})


@pytest.mark.parametrize("attr", ["NotATask", "not_a_class", "_counter"])
def test_load_task_not_a_task(attr: str) -> None:
    with pytest.raises(TaskSpecError, match=r"not a subclass of geofed\.task\.Task"):
        load_task(f"{__name__}:{attr}", {})


def test_load_task_abstract_class_names_missing_methods() -> None:
    with pytest.raises(TaskSpecError, match=r"is abstract \(missing batches, loss, tokens\)"):
        load_task(f"{__name__}:HalfDoneTask", {})


def test_load_task_module_raising_on_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = _write_module(tmp_path, monkeypatch, "raise RuntimeError('boom at import')\n")
    with pytest.raises(TaskSpecError, match=r"importing .* failed: RuntimeError: boom at import"):
        load_task(f"{name}:Anything", {})


def test_load_task_module_with_missing_dependency(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = _write_module(tmp_path, monkeypatch, "import geofed_absent_dependency\n")
    with pytest.raises(TaskSpecError, match=r"importing .* failed: .*geofed_absent_dependency"):
        load_task(f"{name}:Anything", {})


def test_load_task_class_from_a_fresh_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = _write_module(
        tmp_path,
        monkeypatch,
        f"from {__name__} import PlainTask\n\nclass Mine(PlainTask):\n    pass\n",
    )
    cls = load_task_class(f"{name}:Mine")
    assert issubclass(cls, PlainTask)
    assert cls.__name__ == "Mine"


def test_unknown_option_is_named() -> None:
    with pytest.raises(TaskOptionsError, match="colour: Extra inputs are not permitted"):
        load_task(f"{__name__}:ScaledTask", {"colour": "red"})


def test_wrongly_typed_option_is_named() -> None:
    with pytest.raises(TaskOptionsError, match="width: Input should be a valid integer"):
        load_task(f"{__name__}:ScaledTask", {"width": "wide"})


def test_options_for_task_without_options() -> None:
    with pytest.raises(TaskOptionsError, match="takes no options, got: a, b"):
        load_task(f"{__name__}:PlainTask", {"b": 1, "a": 2})


def test_options_must_be_a_mapping() -> None:
    with pytest.raises(TaskOptionsError, match="must be a mapping, got list"):
        load_task(f"{__name__}:ScaledTask", [("scale", 1.0)])  # type: ignore[arg-type]


def test_options_model_must_be_pydantic() -> None:
    with pytest.raises(TaskSpecError, match="Options must be a pydantic BaseModel"):
        load_task(f"{__name__}:BadOptionsTask", {"x": 1})


def test_base_defaults() -> None:
    task = PlainTask()
    model = task.build_model()
    optimizer = task.build_optimizer(model.parameters())
    assert isinstance(optimizer, torch.optim.AdamW)
    assert task.evaluate(model) == {}
    shard = DataShard("r", 0, 1, 0, 1, 0)
    assert list(itertools.islice(task.batches(shard, 5), 3)) == [5, 6, 7]


@pytest.mark.parametrize(
    ("spec", "allowed"),
    [
        ("geofed.examples.charlm:CharLMTask", DEFAULT_TASK_MODULES),
        ("geofed.examples:Anything", DEFAULT_TASK_MODULES),
        ("acme.tasks:T", ("acme.tasks",)),
        ("acme.tasks.deep:T", ("acme.*",)),
    ],
)
def test_task_modules_the_allow_list_names_are_allowed(spec: str, allowed: tuple[str, ...]) -> None:
    assert task_module_refusal(spec, allowed) is None


@pytest.mark.parametrize(
    ("spec", "allowed"),
    [
        ("this:Task", DEFAULT_TASK_MODULES),
        ("geofed.task:Task", DEFAULT_TASK_MODULES),
        ("geofed.examples_evil:T", DEFAULT_TASK_MODULES),
        ("acme.tasks.deep:T", ("acme.tasks",)),
        ("acme:T", ()),
    ],
)
def test_other_task_modules_are_refused_naming_the_module(
    spec: str, allowed: tuple[str, ...]
) -> None:
    reason = task_module_refusal(spec, allowed)
    assert reason is not None
    assert repr(spec.split(":")[0]) in reason


@pytest.mark.parametrize("pattern", ["", "acme.", "acme.*.x", "*", "acme.t*", "a b"])
def test_malformed_task_module_patterns_are_refused(pattern: str) -> None:
    with pytest.raises(ValueError, match="task module pattern"):
        validate_module_pattern(pattern)
