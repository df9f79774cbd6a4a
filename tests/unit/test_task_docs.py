"""The worked example of docs/tasks.md runs as written: a user's own task in < 60 lines."""

from __future__ import annotations

import itertools
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from coordinator.jobs.initial_build import initial_parameters
from geofed.params import federated_state, load_federated_state, parameters_vector_hash
from geofed.task import DataShard, Task, load_task

DOC = Path(__file__).resolve().parents[2] / "docs" / "tasks.md"
MODULE = "geofed_docs_example_tasks"


def _example() -> str:
    text = DOC.read_text()
    section = text[text.index("## A worked example") :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "docs/tasks.md lost its worked example"
    return match.group(1)


@pytest.fixture
def sine_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Task[object]]:
    package = tmp_path / MODULE
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "sine.py").write_text(_example())
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield load_task(f"{MODULE}.sine:SineTask", {"width": 16, "depth": 2})
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == MODULE]:
            del sys.modules[name]


def test_the_example_is_short() -> None:
    assert len(_example().splitlines()) < 60


def test_the_example_task_is_federated_without_its_int_buffer(sine_task: Task[object]) -> None:
    model = sine_task.build_model(seed=1)
    assert "calls" in model.state_dict()
    assert "calls" not in federated_state(model)
    theta0 = initial_parameters(sine_task, seed=1)
    assert set(theta0) == set(federated_state(model))
    fresh = sine_task.build_model(seed=2)
    load_federated_state(fresh, theta0)
    assert parameters_vector_hash(fresh) == parameters_vector_hash(theta0)
    blocks = model.get_submodule("blocks")
    assert isinstance(blocks, torch.nn.ModuleList)
    assert list(sine_task.fsdp_units(model)) == list(blocks)
    assert sine_task.checkpoint_units(model) == ()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Train as workers do; two threads on two shared cores slow down under load."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("one_thread")
def test_the_example_task_trains(sine_task: Task[object]) -> None:
    shard = DataShard("eu-west", 1, 2, 0, 1, 7)
    again = next(sine_task.batches(shard, start_step=5))
    batches = list(itertools.islice(sine_task.batches(shard), 30))
    assert isinstance(again, tuple)
    assert isinstance(batches[5], tuple)
    assert all(torch.equal(a, b) for a, b in zip(batches[5], again, strict=True))
    model = sine_task.build_model(seed=0)
    optimizer = sine_task.build_optimizer(model.parameters())
    losses = []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = sine_task.loss(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) < sum(losses[:5])
    assert sine_task.tokens(batches[0]) == 32
