"""Killed workers and the overlap modes in one real federation (embedded broker, coordinator
and two agents as processes, mutual TLS, real worker groups: two ranks in eu-west (DDP),
one in us-east), four jobs one after the other on the same daemons and worker groups.

What it proves, job by job:

- ``overlap: none``: eu-west's rank 0 (the rank that answers the agent) is killed with
  SIGKILL while it trains round 1 (its instruction handed over, its done marker not yet
  written). The launcher restarts the group in place (the same launch) from the regional
  checkpoint of round 0, the agent (the same process throughout) counts the restart (its
  status and ``geofed_agent_worker_restarts_total``), the region redoes only the round in
  progress and still delivers it, and every round is published once.
- ``overlap: delayed``: regions train round r+1 before θ_{r+1} exists anywhere (a round's
  training starts before the coordinator announces that round), fold θ_{r+1} in when it
  comes, and still end every round holding exactly the coordinator's θ; a worker killed
  with SIGKILL in the middle of such a round costs only that round's speculative steps
  (eu-west's rank 0 is killed in round 1, us-east trains undisturbed).
- ``overlap: streaming``: each round's published update names only the fragment
  ``r mod F``, every other tensor of θ_{r+1} is θ_r's bit for bit, regions train ahead of
  θ as under ``delayed`` and still end every round on exactly the coordinator's θ; the
  same kill costs only that round's speculative steps (and the local progress of
  fragments not synchronized since).
- ``overlap: delayed`` with ``overlap_start: eager``: the coordinator sends the job's outer
  optimizer config to the regions; each region, having trained round r, hands its workers
  the eager estimate S of θ_{r+1} (replaying the outer optimizer from the published θs
  from round 1 on), the workers start every round after the first from S, fold θ_{r+1} in
  when it comes, and every region still ends every round holding exactly the
  coordinator's θ.

Each kill is one in-place restart of eu-west's group: three in all, within the
launcher's default ``max_restarts`` of 3.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
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
    ControlObserver,
    agent_metrics,
    audit_entries,
    check_same_parameters,
    observed_federation,
    poll,
    sample,
)
from tests.support.overlap_run import (
    ahead,
    kill_rank0_ahead_of_theta,
    opened_at,
    rank_status,
    workers_dir,
)
from tests.support.waiting import alive

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REGIONS = ("eu-west", "us-east")
ROUNDS = 3
INNER_STEPS = 12
#: The serial job's inner steps: enough that its workers train for a moment, so the kill
#: lands inside the round.
SERIAL_INNER_STEPS = 20
FRAGMENTS = 2
#: The region whose rank 0 is killed, and the round it is killed in.
VICTIM, KILLED_ROUND = "eu-west", 1
_FROM_S = re.compile(
    r"job (\S+) round (\d+): starting from the eager estimate S ([0-9a-f]{64}) "
    r"\(([0-9.]+) s waited for it\)"
)
_HANDED = re.compile(
    r"job (\S+): round (\d+) starts from the eager estimate \(outer optimizer (\w+)"
)


def configure(name: str, data: dict[str, Any]) -> None:
    """Two workers in eu-west (DDP), one in us-east (few cores here)."""
    if name == "agent-us-east":
        data["workers"]["count"] = 1


Kill = Callable[[FederationRun, str], Awaitable[None]]


async def kill_ahead_of_theta(fed: FederationRun, job: str) -> None:
    await kill_rank0_ahead_of_theta(fed, VICTIM, job, KILLED_ROUND)


async def run_job(
    fed: FederationRun, observer: ControlObserver, job: str, kill: Kill | None, **spec: Any
) -> dict[str, Any]:
    """Submit ``job`` with ``spec``, run ``kill`` on it (if any), and return its final
    status once every region agrees on its θs."""
    status, body = await fed.submit({**fed.job_spec(), "job": job, **spec})
    assert status == 201, body
    if kill is not None:
        await kill(fed, job)
    final = await fed.wait_for(
        lambda s: (
            s.get("state") == "completed"
            and any(e["round"] == ROUNDS for e in s.get("val_loss_history", []))
        ),
        timeout_s=WAIT_S,
        what=f"{job} to complete and its last parameters to be evaluated",
        job=job,
    )
    await check_same_parameters(
        fed, observer, ROUNDS, {region: set(range(ROUNDS)) for region in REGIONS}, job=job
    )
    assert final["round"] == ROUNDS
    entries = await audit_entries(fed, job=job, verify=True)
    accepts = sorted((e.round, e.region) for e in entries if e.action == "delta.accept")
    assert accepts == [(r, g) for r in range(ROUNDS) for g in sorted(REGIONS)]
    return final


def rank0_log(fed: FederationRun, region: str) -> str:
    return (workers_dir(fed, region) / "logs" / "rank-0.log").read_text(errors="replace")


def check_trained_ahead(
    fed: FederationRun,
    observer: ControlObserver,
    job: str,
    trained_ahead: dict[str, dict[int, tuple[float, int]]],
) -> None:
    """Round 0 started from θ_0 and every later round ahead of θ, from the local
    parameters, but the victim's killed round: its group resumed from the regional
    checkpoint of the round before and trained that round serially from θ; the next round
    went ahead of θ again. Every round trained ahead began before θ_round was announced
    (so before it could be had) and folded θ in within the round's steps."""
    log = rank0_log(fed, VICTIM)
    assert f"job {job}: resumed from the regional checkpoint of round {KILLED_ROUND - 1}" in log
    assert f"job {job} round {KILLED_ROUND}: θ came; training from it" in log
    expected = [r for r in range(1, ROUNDS) if r != KILLED_ROUND]
    assert sorted(trained_ahead[VICTIM]) == expected, trained_ahead
    assert sorted(trained_ahead["us-east"]) == list(range(1, ROUNDS)), trained_ahead
    for region, rounds in trained_ahead.items():
        for round_, (started_at, fold_step) in rounds.items():
            assert started_at < opened_at(observer, job, round_), (region, round_)
            assert 1 <= fold_step <= INNER_STEPS, (region, round_, fold_step)


def update_tensors(fed: FederationRun, job: str, round_: int) -> list[str]:
    """The tensor names the signed manifest of ``job``'s update ``round_`` lists, read
    from the coordinator's checkpoint location on disk."""
    (index,) = fed.work.rglob(f"jobs/{job}/{INDEX_NAME}")
    location = Location.open("ckpt", "", None, index.parent.parent.parent)
    entry = find_entry(location, job, EntryKind.UPDATE, round_)
    assert entry is not None, f"update {round_} is not stored"
    signed = SignedManifest.from_bytes(location.path_of(entry.manifest_digest).read_bytes())
    return [tensor.name for tensor in signed.manifest.tensors]


def held_theta(
    fed: FederationRun, region: str, job: str, round_: int
) -> Mapping[str, torch.Tensor]:
    params = fed.work / "agents" / region / "jobs" / job / "params"
    return map_params(params / f"round-{round_}.chain.json")


def training(fed: FederationRun, region: str, job: str, round_: int) -> bool:
    """The region's workers hold ``job``'s round ``round_``'s instruction and have not
    finished it."""
    jobs = workers_dir(fed, region) / "jobs" / job
    return (jobs / f"round-{round_}.instruction.json").exists() and not (
        jobs / f"round-{round_}.done.json"
    ).exists()


def agent_pids(fed: FederationRun) -> dict[str, int | None]:
    """The live agent processes: name -> pid (None once exited)."""
    return {
        c.name: c.pid if c.returncode is None else None
        for c in fed.children.children
        if c.name.startswith("agent-")
    }


async def a_serial_round_survives_a_killed_worker(
    fed: FederationRun, observer: ControlObserver
) -> None:
    job = "serial"
    seen: dict[str, Any] = {}

    async def kill_mid_round(fed: FederationRun, job: str) -> None:
        await poll(
            fed,
            lambda: training(fed, VICTIM, job, KILLED_ROUND),
            f"{VICTIM} to train round {KILLED_ROUND} of {job}",
            timeout_s=WAIT_S,
        )
        rank0 = seen["rank0"] = rank_status(fed, VICTIM, 0)
        assert rank0["restart_count"] == 0, rank0
        seen["killed_at"] = time.monotonic()
        os.kill(rank0["pid"], signal.SIGKILL)
        seen["still_training"] = training(fed, VICTIM, job, KILLED_ROUND)
        await poll(
            fed,
            lambda: (
                rank_status(fed, VICTIM, 0)["restart_count"] >= 1
                and rank_status(fed, VICTIM, 0)["state"] == "ready"
            ),
            "the worker group to be restarted",
        )

    await run_job(fed, observer, job, kill_mid_round, inner_steps=SERIAL_INNER_STEPS)
    rank0, restarted = seen["rank0"], rank_status(fed, VICTIM, 0)
    accepted_at = observer.accepted(VICTIM, KILLED_ROUND, job)[-1][0]
    rank_log = rank0_log(fed, VICTIM)

    assert seen["still_training"], "the kill landed after the round had finished"
    assert not alive(rank0["pid"])
    assert restarted["launch_id"] == rank0["launch_id"]  # in place, by the launcher
    assert all(a.overlap == "none" for a in observer.announcements if a.job == job)
    # The new rank 0 took the inner optimizer state and data cursor of the round before.
    assert f"job {job}: resumed from the regional checkpoint of round {KILLED_ROUND - 1}" in (
        rank_log
    )
    print(
        f"\nworker kill: rank 0 of {VICTIM} killed in round {KILLED_ROUND}; rounds lost: 0; "
        f"kill to accepted delta {accepted_at - seen['killed_at']:.1f} s"
    )


async def every_kill_was_one_in_place_restart_seen_by_the_same_agent(
    fed: FederationRun, observer: ControlObserver, agents_before: dict[str, int | None]
) -> None:
    kills = 3
    agent_text = await agent_metrics(fed, VICTIM)
    log = (fed.work / "logs" / f"agent-{VICTIM}.log").read_text(errors="replace")

    assert agent_pids(fed) == agents_before
    assert rank_status(fed, VICTIM, 0)["restart_count"] == kills
    assert sample(agent_text, "geofed_agent_worker_restarts_total", region=VICTIM) == kills
    reported = [s.worker_restarts for _, s in observer.statuses if s.region == VICTIM]
    assert max(reported) == kills, reported
    for n in range(1, kills + 1):
        assert f"worker group restarted by its launcher ({n} so far)" in log


async def delayed_rounds_train_ahead_of_theta_agree_and_survive_a_killed_worker(
    fed: FederationRun, observer: ControlObserver
) -> None:
    job = "overlap-delayed"
    await run_job(fed, observer, job, kill_ahead_of_theta, overlap="delayed")
    trained_ahead = {region: ahead(fed, region, job) for region in REGIONS}

    assert all(a.overlap == "delayed" for a in observer.announcements if a.job == job)
    check_trained_ahead(fed, observer, job, trained_ahead)


async def streaming_rounds_publish_one_fragment_each_and_survive_a_killed_worker(
    fed: FederationRun, observer: ControlObserver
) -> None:
    job = "overlap-streaming"
    await run_job(fed, observer, job, kill_ahead_of_theta, overlap="streaming", fragments=FRAGMENTS)
    trained_ahead = {region: ahead(fed, region, job) for region in REGIONS}
    published = {r: update_tensors(fed, job, r) for r in range(ROUNDS)}
    # The agent keeps θ of the last two versions: they differ only where the last
    # round's fragment is.
    before = held_theta(fed, "us-east", job, ROUNDS - 2)
    after = held_theta(fed, "us-east", job, ROUNDS - 1)

    announced = [a for a in observer.announcements if a.job == job]
    assert all((a.overlap, a.fragments) == ("streaming", FRAGMENTS) for a in announced)
    plan = fragment_plan({name: tuple(t.shape) for name, t in after.items()}, FRAGMENTS)
    for round_, names in published.items():
        assert names == list(plan.names(round_)), round_
    assert set(published[0]).isdisjoint(published[1])
    assert set(published[0]) | set(published[1]) == set(after)
    moved = {name for name in after if not torch.equal(after[name], before[name])}
    assert moved
    assert moved <= set(plan.names(ROUNDS - 2)), moved

    check_trained_ahead(fed, observer, job, trained_ahead)


async def eager_rounds_start_from_the_estimate_and_agree_with_the_coordinator(
    fed: FederationRun, observer: ControlObserver
) -> None:
    job = "overlap-eager"
    await run_job(fed, observer, job, None, overlap="delayed", overlap_start="eager")
    from_s = {
        region: {
            int(m.group(2)): float(m.group(4))
            for m in _FROM_S.finditer(rank0_log(fed, region))
            if m.group(1) == job
        }
        for region in REGIONS
    }
    agent_logs = {r: (fed.work / "logs" / f"agent-{r}.log").read_text() for r in REGIONS}
    hand = {
        region: {int(m.group(2)): m.group(3) for m in _HANDED.finditer(text) if m.group(1) == job}
        for region, text in agent_logs.items()
    }

    announced = [a for a in observer.announcements if a.job == job]
    assert all(a.overlap_start == "eager" for a in announced)
    assert all(a.outer_optimizer is not None for a in announced)
    for region in REGIONS:
        # Round 0 starts from θ_0; every later round from the agent's estimate S.
        assert sorted(from_s[region]) == list(range(1, ROUNDS)), (region, from_s[region])
        assert all(wait >= 0.0 for wait in from_s[region].values())
        # S of round 1 comes from a replica at zero (no outer step seen yet); from round 2
        # on the agent replays the coordinator's steps.
        expected = {1: "replica", **dict.fromkeys(range(2, ROUNDS), "replayed")}
        assert hand[region] == expected, (region, hand[region])


# Four jobs of three rounds each, one after the other: four times one job's time.
@pytest.mark.timeout(720)
async def test_killed_workers_and_the_overlap_modes_lose_no_round(
    tmp_path: Path,
) -> None:
    async with observed_federation(
        tmp_path,
        regions=REGIONS,
        rounds=ROUNDS,
        inner_steps=INNER_STEPS,
        customize=configure,
        ranks=None,
        submit=False,
    ) as (fed, observer):
        agents_before = agent_pids(fed)
        await a_serial_round_survives_a_killed_worker(fed, observer)
        await delayed_rounds_train_ahead_of_theta_agree_and_survive_a_killed_worker(fed, observer)
        await streaming_rounds_publish_one_fragment_each_and_survive_a_killed_worker(fed, observer)
        await eager_rounds_start_from_the_estimate_and_agree_with_the_coordinator(fed, observer)
        await every_kill_was_one_in_place_restart_seen_by_the_same_agent(
            fed, observer, agents_before
        )
