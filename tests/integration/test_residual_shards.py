"""The error-feedback residual sharded over 3 gloo ranks: gathered whole on rank 0 from
uneven slices, scattered back in place, and written out by a collective at a stop; a
round's delta handed over by the group is the same bytes as one rank's, round after
round, and a failure after part of the residual was replaced (a NaN in a tensor, a file
size limit on rank 0's writes) drops it on every rank and leaves no rank waiting.

One group of 3 spawned processes serves the module (each one's start-up costs seconds):
it runs both scenarios, one after the other, each in a directory of its own, and the
tests check what each rank reported of them."""

from __future__ import annotations

import os
import resource
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.spawn import spawn

from geofed.codec import seal_quantized
from geofed.codec_params import CodecParams
from geofed.ports import unused_port
from geofed.theta_file import write_theta
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.messages import DeltaRequest, RoundInstruction
from regional_agent.handoff.residual_file import Residual, read_residual, write_residual
from regional_agent.worker.device_delta import hand_over_delta, quantize_round_delta
from regional_agent.worker.parallelism import ParallelModel
from regional_agent.worker.persistence import write_out_residual
from regional_agent.worker.place import RankPlace
from regional_agent.worker.residual_shards import DeviceResidual, ResidualGroup, span
from tests.support.worker_group import instruction

pytestmark = pytest.mark.integration

WORLD = 3
# Uneven on purpose: fewer elements than ranks, none, and sizes W does not divide.
SHAPES = {"w": (5, 7), "b": (7,), "one": (1,), "none": (0, 4), "v": (3, 2)}
#: The scenarios' directories under the module's.
SHARDED, HAND_OVER = "sharded", "hand-over"


def _wholes(scale: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return {name: torch.randn(shape, generator=generator) * scale for name, shape in SHAPES.items()}


def _own(whole: torch.Tensor, rank: int) -> torch.Tensor:
    """``rank``'s slice of ``whole`` (a copy)."""
    begin, end = span(whole.numel(), rank, WORLD)
    return whole.reshape(-1)[begin:end].clone()


def _sharded(rank: int, out: Path) -> None:
    """Gather, scatter, broadcast and write out a residual sharded over the group."""
    cpu = torch.device("cpu")
    group = ResidualGroup(rank, WORLD, cpu)
    old, new = _wholes(1.0), _wholes(2.0)
    slices = {name: _own(whole, rank) for name, whole in old.items()}
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
        same = same and got is into and torch.equal(got, _own(new[name], rank))
    report["scattered_in_place"] = same
    report["broadcast"] = group.broadcast("rank 0's word" if rank == 0 else None)
    kept = DeviceResidual("job-a", 4, "id-4", slices, dict(SHAPES), written=False)
    place = RankPlace(HandoffDir(out / "handoff"), rank, WORLD, None, cpu)
    report["written"] = write_out_residual(place, kept).written  # type: ignore[union-attr]
    torch.save(report, out / f"rank-{rank}.pt")


def test_a_residual_sharded_over_three_ranks_gathers_scatters_and_writes_out_whole(
    spawned: Path,
) -> None:
    out = spawned / SHARDED
    reports = [torch.load(out / f"rank-{r}.pt", weights_only=True) for r in range(WORLD)]
    for name, shape in SHAPES.items():  # every element kept by exactly one rank
        assert sum(r["sizes"][name] for r in reports) == torch.Size(shape).numel()
    assert reports[0]["sizes"]["one"] == 1
    assert all(r["gathered"] and r["scattered_in_place"] for r in reports)
    assert all(r["broadcast"] == "rank 0's word" for r in reports)
    assert all(r["written"] for r in reports)
    written = read_residual(HandoffDir(out / "handoff").held_residual_path("job-a"))
    assert isinstance(written, Residual)
    assert (written.round, written.id) == (4, "id-4")
    want = _wholes(2.0)  # the slices were scattered the new values in place
    assert list(written.tensors) == list(SHAPES)
    assert all(torch.equal(written.tensors[n], want[n]) for n in SHAPES)


CODEC = CodecParams(scheme="int8", block_size=16)


def _model(scale: float) -> nn.Sequential:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(13, 7), nn.Linear(7, 5))
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.mul_(scale)
    return model


def _instruction(round_: int, base: Path, feedback: Path) -> RoundInstruction:
    return instruction("job-a", round_, base, delta=DeltaRequest(CODEC, str(feedback), 16))


def _hand_over(rank: int, root: Path, limit: int) -> None:
    """Rounds 0 and 1 handed over by the group (the residual kept between checkpoints,
    each delta taken by the agent), then round 2 with a NaN in rank 0's third tensor, then
    rounds 3 (taken) and 4, a checkpoint round whose files rank 0 may write only up to
    ``limit`` bytes."""
    handoff = HandoffDir(root / "handoff")
    place = RankPlace(handoff, rank, WORLD, None, torch.device("cpu"))
    base, feedback = root / "theta.safetensors", root / "feedback.pt"
    report: dict[str, object] = {}
    kept: DeviceResidual | None = None
    for round_ in range(5):
        model = _model(0.9 + 0.05 * round_)
        if round_ == 2 and rank == 0:
            layer = model[1]
            assert isinstance(layer, nn.Linear)
            with torch.no_grad():
                layer.weight[0, 0] = float("nan")
        step = _instruction(round_, base, feedback)
        assert step.delta is not None
        limited = round_ == 4 and rank == 0
        if limited:  # a disk that fills up: writes past the limit fail (EFBIG)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        delta, failure, kept, _ = hand_over_delta(
            place,
            step.delta,
            step,
            str(base),
            ParallelModel("ddp", model, model),
            round_ == 4,
            kept,
        )
        if limited:
            resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        stream = None if delta is None else delta.path.read_bytes()
        report[f"round {round_}"] = (stream, failure, None if kept is None else kept.id)
        dist.barrier()
        if rank == 0 and round_ in (0, 1, 3):  # the agent took the delta and its residual
            handoff.residual_path("job-a", round_).replace(feedback)
        dist.barrier()
    torch.save(report, root / f"hand-over-{rank}.pt")


def _group(rank: int, port: int, out: str, limit: int) -> None:
    """One rank of the module's group: both scenarios, each in its own directory."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        _sharded(rank, Path(out) / SHARDED)
        dist.barrier()
        _hand_over(rank, Path(out) / HAND_OVER, limit)
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory the module's group of WORLD spawned ranks ran both scenarios in."""
    root = tmp_path_factory.mktemp("residual-shards")
    (root / SHARDED).mkdir()
    hand_over = root / HAND_OVER
    hand_over.mkdir()
    base = hand_over / "theta.safetensors"
    write_theta(base, dict(_model(1.0).state_dict()))
    # Rank 0 may write a residual file of this size less the last tensor's bytes but one.
    probe = hand_over / "probe"
    write_residual(probe, 4, dict(_model(1.0).state_dict()))
    limit = probe.stat().st_size - 4 * 5 + 1
    probe.unlink()
    spawn(_group, args=(unused_port(), str(root), limit), nprocs=WORLD, join=True)
    return root


def test_a_delta_handed_over_by_three_ranks_is_one_ranks_and_a_failure_drops_the_residual(
    spawned: Path,
) -> None:
    root = spawned / HAND_OVER
    base = root / "theta.safetensors"
    reports = [torch.load(root / f"hand-over-{r}.pt", weights_only=True) for r in range(WORLD)]
    # One rank alone, from the same θ and trained states, keeping its residual.
    alone = root / "alone"
    alone.mkdir()
    kept = None
    for round_ in range(2):
        quantized, kept = quantize_round_delta(
            DeltaRequest(CODEC, str(alone / "feedback.pt"), 16),
            job="job-a",
            round_=round_,
            region="eu-west",
            base_path=str(base),
            local=dict(_model(0.9 + 0.05 * round_).state_dict()),
            residual_path=alone / f"round-{round_}.residual.pt",
            kept=kept,
            write_tensors=False,
        )
        (alone / f"round-{round_}.residual.pt").replace(alone / "feedback.pt")
        stream, failure, id_ = reports[0][f"round {round_}"]
        assert failure is None
        assert stream == seal_quantized(quantized).to_bytes()  # round 1 used the kept one
        assert all(r[f"round {round_}"][2] == id_ for r in reports)  # every rank keeps it
        assert all(r[f"round {round_}"][:2] == (None, None) for r in reports[1:])
    stream, failure, id_ = reports[0]["round 2"]
    assert stream is None
    assert id_ is None
    assert failure.startswith("cannot hand over the delta")
    assert "finite" in failure
    # The first tensors' residual was replaced before the NaN: no rank keeps any of it.
    assert all(r["round 2"] == (None, None, None) for r in reports[1:])
    handoff = HandoffDir(root / "handoff")
    assert not handoff.delta_stream_path("job-a", 2).exists()
    assert not handoff.residual_path("job-a", 2).exists()

    # Round 4 writes its residual, and rank 0's disk fills up: the round fails there, every
    # rank returns from it and drops what it held, and nothing of the round is left.
    taken = reports[0]["round 3"]
    assert taken[1] is None
    assert all(r["round 3"][2] == taken[2] for r in reports)
    stream, failure, id_ = reports[0]["round 4"]
    assert stream is None
    assert "File too large" in failure
    assert all(r["round 4"] == (None, None, None) for r in reports[1:])
    assert id_ is None
    assert not handoff.delta_stream_path("job-a", 4).exists()
    assert not handoff.residual_path("job-a", 4).exists()
    assert (
        sorted(p.name for p in handoff.job_dir("job-a").iterdir() if p.name.startswith(".")) == []
    )
