"""A rank's model is built on the meta device where the task allows it, else on the host."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from geofed.examples.charlm.task import CharLMTask
from geofed.examples.llama.task import LlamaOptions, LlamaTask
from geofed.params import federated_state
from geofed.task import DataShard, Task
from regional_agent.worker.model_build import build_model, meta_refusal, non_federated_names

CPU = torch.device("cpu")


class _BufferTask(Task[Any]):
    """A task whose model holds an integer buffer and defines no init_non_federated."""

    def build_model(self, seed: int | None = None) -> nn.Module:
        model = nn.Linear(4, 4)
        model.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        return model

    def batches(self, shard: DataShard, start_step: int = 0) -> Iterator[Any]:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def tokens(self, batch: Any) -> int:
        raise NotImplementedError


class _HostTask(_BufferTask):
    """A task whose build_model puts its tensors on the CPU explicitly."""

    def build_model(self, seed: int | None = None) -> nn.Module:
        return nn.Linear(4, 4, device="cpu")


class _TiedTask(_BufferTask):
    """A task whose two modules share one parameter (to_empty would untie them)."""

    def build_model(self, seed: int | None = None) -> nn.Module:
        model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
        model[1].weight = model[0].weight
        return model


def test_llama_builds_on_meta_and_its_rope_table_matches_the_host_build() -> None:
    task = LlamaTask(LlamaOptions(dim=32, n_layers=2, n_heads=4, seq_len=16))
    built = build_model(task, seed=3, device=CPU)
    assert built.materialize is not None, built.reason
    assert all(p.is_meta for p in built.model.parameters())
    assert non_federated_names(built.model) == ["freqs_cis"]
    built.model.to_empty(device=CPU)
    built.materialize(built.model)
    host = task.build_model(seed=3)
    assert torch.equal(built.model.freqs_cis, host.freqs_cis)  # type: ignore[arg-type]
    # The federated tensors are θ's to fill: the same names and shapes as the host's.
    meta_state = federated_state(built.model)
    assert {n: t.shape for n, t in meta_state.items()} == {
        n: t.shape for n, t in federated_state(host).items()
    }


def test_a_model_of_parameters_only_needs_no_hook() -> None:
    built = build_model(CharLMTask(), seed=0, device=CPU)
    assert built.materialize is not None, built.reason
    assert non_federated_names(built.model) == []


def test_a_task_that_cannot_build_on_meta_is_built_on_the_host_and_says_why() -> None:
    built = build_model(_BufferTask(), seed=0, device=CPU)
    assert built.materialize is None
    assert not any(p.is_meta for p in built.model.parameters())
    assert "steps" in built.reason
    assert "init_non_federated" in built.reason
    host = build_model(_HostTask(), seed=0, device=CPU)
    assert host.materialize is None
    assert "off the meta device (bias, weight)" in host.reason
    tied = build_model(_TiedTask(), seed=0, device=CPU)
    assert tied.materialize is None
    assert "0.weight and 1.weight" in tied.reason


def test_meta_refusal_accepts_non_federated_tensors_when_the_task_fills_them() -> None:
    with torch.device("meta"):
        model = _BufferTask().build_model()
    assert meta_refusal(model, can_init_non_federated=True) is None
    reason = meta_refusal(model, can_init_non_federated=False)
    assert reason is not None
    assert "steps" in reason
