"""A fake task at the outer edge: a 2-layer MLP learning a fixed random linear map.

Implements the :class:`geofed.task.Task` API with synthetic data so worker-group tests
train real rounds in milliseconds. The batch at a step is a pure function of
``(shard, step)``. ``step_delay_s`` slows every loss call down, so a test can act
while a round is in progress; ``slow_rank`` with ``slow_rank_delay_s`` slows one rank's
only (a straggler inside the region).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 -- the conventional torch alias
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from geofed.task import DataShard, Task

SPEC = "tests.support.tiny_task:TinyTask"


class TinyOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    in_dim: int = Field(default=8, ge=1)
    hidden: int = Field(default=16, ge=1)
    out_dim: int = Field(default=2, ge=1)
    batch_size: int = Field(default=4, ge=1)
    lr: float = Field(default=1e-2, gt=0)
    seed: int = Field(default=0, ge=0)
    step_delay_s: float = Field(default=0.0, ge=0)
    slow_rank: int | None = Field(default=None, ge=0)
    slow_rank_delay_s: float = Field(default=0.0, ge=0)


@dataclass(frozen=True, slots=True)
class TinyBatch:
    inputs: torch.Tensor
    targets: torch.Tensor


def _generator(*key: object) -> torch.Generator:
    digest = hashlib.sha256("/".join(map(str, key)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


class TinyTask(Task[TinyBatch]):
    Options = TinyOptions

    def __init__(self, options: TinyOptions | None = None) -> None:
        self.options = options if options is not None else TinyOptions()
        opts = self.options
        self._teacher = torch.randn(opts.in_dim, opts.out_dim, generator=_generator("teacher"))

    def build_model(self, seed: int | None = None) -> nn.Module:
        opts = self.options
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(opts.seed if seed is None else seed)
            return nn.Sequential(
                nn.Linear(opts.in_dim, opts.hidden), nn.Tanh(), nn.Linear(opts.hidden, opts.out_dim)
            )

    def build_optimizer(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.options.lr)

    def batch_at(self, shard: DataShard, step: int) -> TinyBatch:
        """The batch a worker of ``shard`` trains on at data step ``step``."""
        opts = self.options
        gen = _generator(
            shard.seed, shard.region_index, shard.num_regions, shard.rank, shard.world_size, step
        )
        inputs = torch.randn(opts.batch_size, opts.in_dim, generator=gen)
        noise = 0.01 * torch.randn(opts.batch_size, opts.out_dim, generator=gen)
        return TinyBatch(inputs=inputs, targets=inputs @ self._teacher + noise)

    def batches(self, shard: DataShard, start_step: int = 0) -> Iterator[TinyBatch]:
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        step = start_step
        while True:
            yield self.batch_at(shard, step)
            step += 1

    def loss(self, model: nn.Module, batch: TinyBatch) -> torch.Tensor:
        if self.options.step_delay_s:
            time.sleep(self.options.step_delay_s)
        slow = self.options.slow_rank
        if slow is not None and dist.is_initialized() and dist.get_rank() == slow:
            time.sleep(self.options.slow_rank_delay_s)
        device = next(model.parameters()).device
        return F.mse_loss(model(batch.inputs.to(device)), batch.targets.to(device))

    def tokens(self, batch: TinyBatch) -> int:
        return int(batch.inputs.shape[0])
