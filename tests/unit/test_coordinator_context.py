"""θ_0 is the federated state: complex and integer buffers are left out, never refused."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from coordinator.jobs.initial_build import BuildFailed, initial_parameters
from geofed.params import parameters_vector_hash
from geofed.task import DataShard, Task


class _BufferTask(Task[torch.Tensor]):
    """A model with a complex64 and an int64 persistent buffer, or with no float state."""

    def __init__(self, floats: bool = True) -> None:
        self.floats = floats

    def build_model(self, seed: int | None = None) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0 if seed is None else seed)
            model = nn.Linear(3, 2) if self.floats else nn.Module()
        model.register_buffer("table", torch.polar(torch.ones(4), torch.arange(4.0)))
        model.register_buffer("count", torch.tensor(3))
        if self.floats:
            model.register_buffer("scale", torch.ones(2, dtype=torch.float16))
        return model

    def batches(self, shard: DataShard, start_step: int = 0) -> Iterator[torch.Tensor]:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def tokens(self, batch: torch.Tensor) -> int:
        raise NotImplementedError


def test_theta0_leaves_out_complex_and_integer_buffers() -> None:
    task = _BufferTask()
    theta0 = initial_parameters(task, seed=4)
    assert set(theta0) == {"weight", "bias", "scale"}
    assert {t.dtype for t in theta0.values()} == {torch.float32}
    assert parameters_vector_hash(initial_parameters(task, seed=4)) == parameters_vector_hash(
        theta0
    )
    assert torch.equal(theta0["scale"], torch.ones(2))


def test_a_model_without_floating_state_is_refused() -> None:
    with pytest.raises(BuildFailed, match="no floating-point parameters"):
        initial_parameters(_BufferTask(floats=False), seed=0)
