"""The worker's training helpers that need no process group: which modules recompute
their activations, the compute precision, and what the regional checkpoint records."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from torch import nn

from geofed.task import DataShard, Task
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.errors import InvalidHandoffData
from regional_agent.handoff.messages import RegionalCheckpoint
from regional_agent.worker.activation_checkpointing import (
    ActivationCheckpointingError,
    checkpoint_activations,
    checkpointed_modules,
)
from regional_agent.worker.precision import autocast, mixed_precision_policy


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 2)
        self.register_buffer("table", torch.ones(3, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        out: torch.Tensor = self.head(x)
        return out


class StackTask(Task[torch.Tensor]):
    def __init__(self, declared: bool = False) -> None:
        self.declared = declared

    def build_model(self, seed: int | None = None) -> nn.Module:
        torch.manual_seed(0 if seed is None else seed)
        return Stack()

    def batches(self, shard: DataShard, start_step: int = 0) -> Iterator[torch.Tensor]:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(batch).pow(2).mean()
        return out

    def tokens(self, batch: torch.Tensor) -> int:
        return int(batch.shape[0])

    def checkpoint_units(self, model: nn.Module) -> Sequence[nn.Module]:
        if not self.declared:
            return ()
        assert isinstance(model, Stack)
        return (model.head,)


def test_declared_checkpoint_units_win_over_the_block_lists() -> None:
    model = Stack()
    assert checkpointed_modules(StackTask(declared=True), model) == (model.head,)
    assert checkpointed_modules(StackTask(), model) == tuple(model.blocks)


def test_a_model_without_blocks_cannot_be_checkpointed() -> None:
    with pytest.raises(ActivationCheckpointingError, match="declares no checkpoint_units"):
        checkpointed_modules(StackTask(), nn.Sequential(nn.Linear(2, 2)))


def test_recomputed_blocks_give_the_same_loss_gradients_and_names() -> None:
    task = StackTask()
    plain, recomputed = task.build_model(), task.build_model()
    names = [name for name, _ in recomputed.named_parameters()]
    checkpoint_activations(checkpointed_modules(task, recomputed))
    x = torch.randn(5, 4)
    for model in (plain, recomputed):
        task.loss(model, x).backward()
    assert [name for name, _ in recomputed.named_parameters()] == names
    assert set(recomputed.state_dict()) == set(plain.state_dict())
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters(), strict=True):
        assert a.grad is not None
        assert b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_bf16_is_autocast_only_under_ddp() -> None:
    cpu = torch.device("cpu")
    layer = nn.Linear(4, 4)
    with autocast("bf16", "ddp", cpu):
        assert layer(torch.randn(2, 4)).dtype == torch.bfloat16
    for precision, parallelism in (("bf16", "fsdp"), ("fp32", "ddp"), ("fp32", "fsdp")):
        context = autocast(precision, parallelism, cpu)  # type: ignore[arg-type]
        assert isinstance(context, contextlib.nullcontext)


def test_fsdp_policy_computes_in_bf16_and_reduces_in_fp32() -> None:
    policy = mixed_precision_policy("bf16")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    fp32 = mixed_precision_policy("fp32")
    assert (fp32.param_dtype, fp32.reduce_dtype) == (None, None)


def test_regional_checkpoint_records_its_parallelism(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    handoff.write_checkpoint(RegionalCheckpoint("job-a", 1, 40, 2, parallelism="fsdp"))
    loaded = handoff.read_checkpoint("job-a")
    assert loaded is not None
    assert loaded.parallelism == "fsdp"
    # A whole-state checkpoint written before the field existed: DDP's state_dict().
    handoff.checkpoint_path("job-a").unlink()
    torch.save(
        {"format": 1, "job": "job-a", "last_round": 1, "cursor": 40, "world_size": 2,
         "optimizer_state": {"state": {}}},
        handoff.whole_checkpoint_path("job-a"),
    )  # fmt: skip
    old = handoff.read_checkpoint("job-a")
    assert old is not None
    assert old.parallelism == "ddp"
    with pytest.raises(InvalidHandoffData, match="parallelism must be one of"):
        RegionalCheckpoint("job-a", 1, 40, 2, {}, "zero3")  # type: ignore[arg-type]
