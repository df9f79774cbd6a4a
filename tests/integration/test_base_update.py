"""θ made on the ranks from the θ their shards hold and the round's update, with 2 gloo
ranks under DDP, FSDP2 and HSDP (:mod:`regional_agent.worker.base_update`).

A serial round's hand-over puts θ_0 back into the model (the delta taken, the trained
values spent); the update of round 0, sent as its chunk frames, then makes θ_1 on every
rank's shards: bit for bit the θ_1 an agent's chain holds (and its hash); and from θ_0,
round 0's and round 1's updates in turn make θ_2 (a region that sat out round 1). An
update whose stored frame no longer matches its digest, or that rank 0 cannot read to its
end, is refused on every rank, and none is left in a collective.

One group of 2 spawned processes serves the module: it runs every kind, one after the
other, and the tests check what each rank reported."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.multiprocessing.spawn import spawn

from geofed.codec_params import CodecParams
from geofed.params import federated_state, parameters_vector_hash
from geofed.ports import unused_port
from geofed.theta_chain import StoredUpdate, ThetaChain, params_hash
from geofed.theta_file import read_theta
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.messages import DeltaRequest
from regional_agent.worker import base_update
from regional_agent.worker.base_update import apply_update, apply_updates
from regional_agent.worker.device_delta import hand_over_delta
from regional_agent.worker.parallelism import ParallelModel, hsdp_mesh
from regional_agent.worker.place import RankPlace
from tests.support.global_updates import chained_theta, small_theta, stored_update
from tests.support.pki import make_federation
from tests.support.worker_group import instruction

pytestmark = pytest.mark.integration

WORLD = 2
KINDS = ("ddp", "fsdp", "hsdp")


class _Small(nn.Module):
    """small_theta's tensors, by the same names."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(10, 6))
        self.layer = nn.Linear(6, 6)
        self.head = nn.Parameter(torch.zeros(3, 6))


def _parallel(kind: str) -> ParallelModel:
    model = _Small()
    if kind == "ddp":
        return ParallelModel("ddp", model, model)
    # HSDP: 2 replicas of one rank each; FSDP: both ranks shard every tensor.
    mesh = hsdp_mesh(torch.device("cpu"), 1, timedelta(seconds=60)) if kind == "hsdp" else None
    fully_shard(model.layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return ParallelModel(kind, model, model)  # type: ignore[arg-type]


def _gathered(parallel: ParallelModel) -> dict[str, torch.Tensor]:
    names = list(federated_state(parallel.model))
    return {name: tensor.clone() for name, tensor in parallel.gathered(names)}


def _one_kind(rank: int, root: Path, kind: str) -> dict[str, object]:
    cpu = torch.device("cpu")
    chain = ThetaChain.load(root / "round-1.chain.json")
    update = chain.updates[0]
    theta0 = read_theta(chain.base)
    parallel = _parallel(kind)
    parallel.load_full_state(theta0 if rank == 0 else None)
    with torch.no_grad():  # the round's training
        for tensor in federated_state(parallel.model).values():
            tensor.add_(0.5)
    place = RankPlace(HandoffDir(root / kind), rank, WORLD, None, cpu)
    step = instruction(
        "job-a",
        0,
        chain.base,
        delta=DeltaRequest(CodecParams(scheme="int8", block_size=16), str(root / "fb.pt"), 16),
    )
    assert step.delta is not None
    delta, failure, _, restored = hand_over_delta(
        place, step.delta, step, str(chain.base), parallel, False, None, restore=True
    )
    report: dict[str, object] = {"restored": restored, "failure": failure}
    report["held_theta0"] = parameters_vector_hash(_gathered(parallel))
    report["handed_over"] = delta is not None if rank == 0 else None
    # Under FSDP and HSDP the frames go a few chunks at a time (a tensor's chunks split
    # between broadcasts), under DDP all at once.
    base_update.BATCH_BYTES = (64 << 20) if kind == "ddp" else 100
    report["applied"] = apply_update(parallel, update if rank == 0 else None, None)
    report["theta1"] = parameters_vector_hash(_gathered(parallel))
    # A region that sat out round 1: θ_0 held, θ_2 made with both updates in turn.
    two = ThetaChain.load(root / "round-2.chain.json")
    parallel.load_full_state(theta0 if rank == 0 else None)
    report["applied_two"] = apply_updates(parallel, two.updates if rank == 0 else None, None)
    report["theta2"] = parameters_vector_hash(_gathered(parallel))
    # The update again, now from a file whose second chunk frame changed on the way.
    bad = root / "corrupt.update"
    data = bytearray(update.path.read_bytes())
    data[update.start + sum(update.sizes[:3]) - 3] ^= 0xFF  # in its body
    bad.write_bytes(bytes(data))
    corrupt = StoredUpdate(update.round, bad, update.start, update.sizes, update.digests)
    report["corrupt"] = _refusal(parallel, corrupt if rank == 0 else None)
    # And from a file cut short after its third chunk: rank 0 cannot read the rest.
    cut = root / "cut.update"
    cut.write_bytes(update.path.read_bytes()[: update.start + sum(update.sizes[:4])])
    short = StoredUpdate(update.round, cut, update.start, update.sizes, update.digests)
    report["cut"] = _refusal(parallel, short if rank == 0 else None)
    dist.barrier()
    return report


def _refusal(parallel: ParallelModel, update: StoredUpdate | None) -> str | None:
    try:
        apply_update(parallel, update, None)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        reports = {kind: _one_kind(rank, Path(out), kind) for kind in KINDS}
        torch.save(reports, Path(out) / f"rank-{rank}.pt")
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("base-update")
    fed = make_federation(root / "fed")
    _, first, after = chained_theta(fed, small_theta(), root, job="job-a")
    # θ_2 as an agent holds it: θ_0's file, round 0's update and round 1's.
    second, _ = stored_update(fed, after, root, job="job-a", round_=1, seed=6)
    ThetaChain(root / "theta-0.st", 0, (first, second)).save(root / "round-2.chain.json")
    spawn(_rank, args=(unused_port(), str(root)), nprocs=WORLD, join=True)
    return root, after


def _reports(root: Path, kind: str) -> list[dict[str, Any]]:
    """What each rank reported of ``kind``."""
    return [torch.load(root / f"rank-{r}.pt", weights_only=True)[kind] for r in range(WORLD)]


@pytest.mark.parametrize("kind", KINDS)
def test_the_ranks_make_theta_from_the_theta_they_hold_and_the_update_bit_for_bit(
    spawned: tuple[Path, dict[str, torch.Tensor]], kind: str
) -> None:
    root, after = spawned
    reports = _reports(root, kind)
    theta0 = parameters_vector_hash(small_theta())
    chained = params_hash(root / "round-1.chain.json")  # θ_1 as the agent's chain reads it
    assert chained == parameters_vector_hash(after)
    assert reports[0]["handed_over"] is True
    for report in reports:
        assert report["failure"] is None
        assert report["restored"] is True
        assert report["held_theta0"] == theta0  # the hand-over put θ_0 back
        assert report["applied"] is True
        assert report["theta1"] == chained
        assert report["applied_two"] is True
        assert report["theta2"] == params_hash(root / "round-2.chain.json")


@pytest.mark.parametrize("kind", KINDS)
def test_an_update_frame_that_changed_or_could_not_be_read_is_refused_on_every_rank(
    spawned: tuple[Path, dict[str, torch.Tensor]], kind: str
) -> None:
    root, _ = spawned
    reports = _reports(root, kind)
    # Each rank checks the chunks of its own shard: under FSDP the changed chunk is rank
    # 1's alone, yet both refuse the update, with rank 1's reason.
    finders = "rank 1: " if kind == "fsdp" else "rank 0: "
    for report in reports:
        assert report["corrupt"] is not None
        assert report["corrupt"].startswith(f"UpdateNotApplied: {finders}")
        assert "sha256 tag does not match" in report["corrupt"]
        # Rank 0's read fails part way: the zeros it sends in place are refused too.
        assert report["cut"] is not None
        assert report["cut"].startswith("UpdateNotApplied: rank 0: ")
        assert "the file ends inside the frames of chunks" in report["cut"]
