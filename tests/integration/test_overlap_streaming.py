"""``overlap: streaming`` in a real federation (embedded broker, coordinator and two agents as
processes, mutual TLS, real worker groups).

What it proves, in one run: each round's published update names only the fragment
``r mod F`` of the model, every other tensor of θ_{r+1} is θ_r's bit for bit, regions train
ahead of θ as under ``delayed`` and still end every round on exactly the coordinator's θ;
and a worker killed with SIGKILL in the middle of a speculative round costs only that
round's speculative steps (and the local progress of fragments not synchronized since).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.storage.artifacts import Location, find_entry
from coordinator.storage.checkpoints import INDEX_NAME, EntryKind
from geofed.fragments import fragment_plan
from geofed.manifest import SignedManifest
from geofed.theta_chain import map_params
from tests.support.federation import FederationRun
from tests.support.observe import (
    WAIT_S,
    audit_entries,
    check_same_parameters,
    observed_federation,
)
from tests.support.overlap_run import ahead, kill_rank0_ahead_of_theta, opened_at, workers_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REGIONS = ("eu-west", "us-east")
ROUNDS = 3
INNER_STEPS = 12
FRAGMENTS = 2


def configure(name: str, data: dict[str, Any]) -> None:
    """A streaming job in two fragments; two workers in eu-west (DDP), one in us-east."""
    if name == "job":
        data["overlap"] = "streaming"
        data["fragments"] = FRAGMENTS
    if name == "agent-us-east":
        data["workers"]["count"] = 1


def update_tensors(fed: FederationRun, round_: int) -> list[str]:
    """The tensor names the signed manifest of update ``round_`` lists, read from the
    coordinator's checkpoint location on disk."""
    (index,) = fed.work.rglob(f"jobs/{fed.job}/{INDEX_NAME}")
    location = Location.open("ckpt", "", None, index.parent.parent.parent)
    entry = find_entry(location, fed.job, EntryKind.UPDATE, round_)
    assert entry is not None, f"update {round_} is not stored"
    signed = SignedManifest.from_bytes(location.path_of(entry.manifest_digest).read_bytes())
    return [tensor.name for tensor in signed.manifest.tensors]


def held_theta(fed: FederationRun, region: str, round_: int) -> Mapping[str, torch.Tensor]:
    params = fed.work / "agents" / region / "jobs" / fed.job / "params"
    return map_params(params / f"round-{round_}.chain.json")


async def test_streaming_rounds_publish_one_fragment_each_and_survive_a_killed_worker(
    tmp_path: Path,
) -> None:
    victim, killed_round = "eu-west", 1
    async with observed_federation(
        tmp_path,
        regions=REGIONS,
        rounds=ROUNDS,
        inner_steps=INNER_STEPS,
        customize=configure,
        ranks=None,
    ) as (fed, observer):
        await kill_rank0_ahead_of_theta(fed, victim, killed_round)
        final = await fed.wait_completed(timeout_s=WAIT_S)
        entries = await audit_entries(fed, job=fed.job, verify=True)
        await check_same_parameters(
            fed, observer, ROUNDS, {region: set(range(ROUNDS)) for region in REGIONS}
        )
        trained_ahead = {region: ahead(fed, region) for region in REGIONS}
        rank_log = (workers_dir(fed, victim) / "logs" / "rank-0.log").read_text()
        published = {r: update_tensors(fed, r) for r in range(ROUNDS)}
        # The agent keeps θ of the last two versions: they differ only where the last
        # round's fragment is.
        before = held_theta(fed, "us-east", ROUNDS - 2)
        after = held_theta(fed, "us-east", ROUNDS - 1)

    assert final["round"] == ROUNDS
    announced = [a for a in observer.announcements if a.job == fed.job]
    assert all((a.overlap, a.fragments) == ("streaming", FRAGMENTS) for a in announced)
    accepts = sorted((e.round, e.region) for e in entries if e.action == "delta.accept")
    assert accepts == [(r, g) for r in range(ROUNDS) for g in sorted(REGIONS)]

    plan = fragment_plan({name: tuple(t.shape) for name, t in after.items()}, FRAGMENTS)
    for round_, names in published.items():
        assert names == list(plan.names(round_)), round_
    assert set(published[0]).isdisjoint(published[1])
    assert set(published[0]) | set(published[1]) == set(after)
    moved = {name for name in after if not torch.equal(after[name], before[name])}
    assert moved
    assert moved <= set(plan.names(ROUNDS - 2)), moved

    # The killed group resumed from the regional checkpoint of the round before and
    # trained the killed round serially from θ; the next round went ahead of θ again.
    assert f"resumed from the regional checkpoint of round {killed_round - 1}" in rank_log
    assert f"job {fed.job} round {killed_round}: θ came; training from it" in rank_log
    assert sorted(trained_ahead[victim]) == [r for r in range(1, ROUNDS) if r != killed_round]
    # The other region trained every round after the first ahead of θ.
    assert sorted(trained_ahead["us-east"]) == list(range(1, ROUNDS))
    for region, rounds in trained_ahead.items():
        for round_, (started_at, fold_step) in rounds.items():
            # Training began before θ_round was announced, so before it could be had.
            assert started_at < opened_at(observer, round_), (region, round_)
            assert 1 <= fold_step <= INNER_STEPS, (region, round_, fold_step)
