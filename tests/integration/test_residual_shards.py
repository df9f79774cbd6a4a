"""The error-feedback residual sharded over 3 gloo ranks: gathered whole on rank 0 from
uneven slices, scattered back in place, and written out by a collective at a stop."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from geofed.ports import unused_port
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.residual_file import Residual, read_residual
from regional_agent.worker.persistence import write_out_residual
from regional_agent.worker.place import RankPlace
from regional_agent.worker.residual_shards import DeviceResidual, ResidualGroup

pytestmark = pytest.mark.integration

WORLD = 3
# Uneven on purpose: fewer elements than ranks, none, and sizes W does not divide.
SHAPES = {"w": (5, 7), "b": (7,), "one": (1,), "none": (0, 4), "v": (3, 2)}


def _wholes(scale: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return {name: torch.randn(shape, generator=generator) * scale for name, shape in SHAPES.items()}


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        cpu = torch.device("cpu")
        group = ResidualGroup(rank, WORLD, cpu)
        old, new = _wholes(1.0), _wholes(2.0)
        slices = {name: group.own(whole) for name, whole in old.items()}
        report: dict[str, object] = {"sizes": {n: s.numel() for n, s in slices.items()}}
        gathered = {name: group.gather(slices[name], SHAPES[name]) for name in SHAPES}
        if rank == 0:
            report["gathered"] = all(torch.equal(gathered[n], old[n]) for n in SHAPES)  # type: ignore[arg-type]
        else:
            report["gathered"] = all(tensor is None for tensor in gathered.values())
        same = True
        for name in SHAPES:
            into = slices[name]
            got = group.scatter(new[name] if rank == 0 else None, SHAPES[name], into)
            same = same and got is into and torch.equal(got, group.own(new[name]))
        report["scattered_in_place"] = same
        report["broadcast"] = group.broadcast("rank 0's word" if rank == 0 else None)
        kept = DeviceResidual("job-a", 4, "id-4", slices, dict(SHAPES), written=False)
        place = RankPlace(HandoffDir(Path(out) / "handoff"), rank, WORLD, None, cpu)
        report["written"] = write_out_residual(place, kept).written  # type: ignore[union-attr]
        torch.save(report, Path(out) / f"rank-{rank}.pt")
    finally:
        dist.barrier()
        dist.destroy_process_group()


def test_a_residual_sharded_over_three_ranks_gathers_scatters_and_writes_out_whole(
    tmp_path: Path,
) -> None:
    spawn(_rank, args=(unused_port(), str(tmp_path)), nprocs=WORLD, join=True)

    reports = [torch.load(tmp_path / f"rank-{r}.pt", weights_only=True) for r in range(WORLD)]
    for name, shape in SHAPES.items():  # every element kept by exactly one rank
        assert sum(r["sizes"][name] for r in reports) == torch.Size(shape).numel()
    assert reports[0]["sizes"]["one"] == 1
    assert all(r["gathered"] and r["scattered_in_place"] for r in reports)
    assert all(r["broadcast"] == "rank 0's word" for r in reports)
    assert all(r["written"] for r in reports)
    written = read_residual(HandoffDir(tmp_path / "handoff").held_residual_path("job-a"))
    assert isinstance(written, Residual)
    assert (written.round, written.id) == (4, "id-4")
    want = _wholes(2.0)  # the slices were scattered the new values in place
    assert list(written.tensors) == list(SHAPES)
    assert all(torch.equal(written.tensors[n], want[n]) for n in SHAPES)
