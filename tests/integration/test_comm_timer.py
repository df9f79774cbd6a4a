"""The data-parallel collectives timed, with 2 gloo ranks: DDP's gradient all-reduce by a
communication hook, FSDP2's all-gathers and reduce-scatters by its custom collectives,
HSDP's all-reduce between its replicas (2 replicas of one rank each) from its unit's
reduce to its all-reduce hook.

The timing must change nothing the ranks compute: the same model, data and steps with and
without it give bit-identical parameters, and the time it reports is positive and
within the wall time of the steps.
"""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.multiprocessing.spawn import spawn
from torch.nn.parallel import DistributedDataParallel

from geofed.ports import unused_port
from regional_agent.worker.comm_timer import CommTimer
from regional_agent.worker.parallelism import hsdp_mesh

pytestmark = pytest.mark.integration

WORLD = 2
STEPS = 4
KINDS = ("ddp", "fsdp", "hsdp")


def _wrap(model: nn.Sequential, kind: str, timer: CommTimer | None) -> nn.Module:
    if kind in ("fsdp", "hsdp"):
        # HSDP: replicated across the ranks, each shard group one rank.
        mesh = hsdp_mesh(torch.device("cpu"), 1, timedelta(seconds=60)) if kind == "hsdp" else None
        # Each Linear its own unit: several all-gathers and reduce-scatters a step.
        units = [model[0], model[2]]
        for unit in units:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if timer is not None:
            timer.attach_fsdp([*units, model], replicated=kind == "hsdp")
        return model
    # Small buckets: several all-reduces per backward, in flight together.
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.005)
    if timer is not None:
        timer.attach(ddp)
    return ddp


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _train(rank: int, kind: str, timer: CommTimer | None) -> tuple[dict[str, torch.Tensor], float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    ddp = _wrap(model, kind, timer)
    if timer is not None:
        timer.start()
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)
    started = time.perf_counter()
    for _ in range(STEPS):
        optimizer.zero_grad()
        x = torch.randn(16, 32, generator=data)
        ddp(x).square().mean().backward()
        optimizer.step()
    wall = time.perf_counter() - started
    return {k: _full(v) for k, v in model.state_dict().items()}, wall


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        for kind in KINDS:
            plain, _ = _train(rank, kind, None)
            timer = CommTimer(torch.device("cpu"))
            timed, wall = _train(rank, kind, timer)
            torch.save(
                {"plain": plain, "timed": timed, "seconds": timer.seconds(), "wall": wall},
                Path(out) / f"{kind}-rank-{rank}.pt",
            )
    finally:
        # The DDP reducers go first, and every rank reaches the teardown before any
        # leaves, as the worker does: gloo aborts the process when a peer closes the
        # group under its background threads.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def test_the_timed_collectives_change_nothing_and_measure_time(tmp_path: Path) -> None:
    spawn(_rank, args=(unused_port(), str(tmp_path)), nprocs=WORLD, join=True)

    for kind in KINDS:
        results = [
            torch.load(tmp_path / f"{kind}-rank-{r}.pt", weights_only=True) for r in range(WORLD)
        ]
        for result in results:
            assert result["plain"].keys() == result["timed"].keys()
            for name, tensor in result["plain"].items():
                assert torch.equal(result["timed"][name], tensor), (kind, name)
            assert 0 < result["seconds"] <= result["wall"], kind
        # The ranks stayed in step with each other, too.
        for name, tensor in results[0]["timed"].items():
            assert torch.equal(results[1]["timed"][name], tensor), (kind, name)
