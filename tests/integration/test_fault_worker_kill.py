"""One worker process of a region killed with SIGKILL in the middle of a round.

A real federation (embedded broker, coordinator and two agents as processes, mutual TLS,
SQLite), a job of two rounds. eu-west runs two gloo workers; while they train round 1,
the last (its instruction is handed over, its done marker not yet written), rank 0 (the
rank that answers the agent) is killed. The agent itself stays up. Nothing is evaluated
(``evaluation: none``): no assertion here looks at a loss.

What it proves: the worker group is restarted (the launcher's in-place restart) from the
regional checkpoint of the previous round, the agent counts the restart (its status and
``geofed_agent_worker_restarts_total`` on its ``/metrics``), the region redoes only the
round in progress and still delivers it, the job completes with every round published
once, and both regions trained every round from the same announced parameters.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.federation import FederationRun
from tests.support.observe import (
    WAIT_S,
    agent_metrics,
    audit_entries,
    check_same_parameters,
    observed_federation,
    poll,
    sample,
)
from tests.support.waiting import alive

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REGIONS = ("eu-west", "us-east")
VICTIM = "eu-west"
#: Round 0 leaves the regional checkpoint the restarted group resumes from; round 1 is
#: the one killed and redone.
ROUNDS = 2
#: Enough inner steps that the workers train for a moment each round: the kill lands
#: inside a round.
INNER_STEPS = 20
KILLED_ROUND = 1


def configure(name: str, data: dict[str, Any]) -> None:
    """Two workers for the victim; one for the other region (this machine has few cores);
    no evaluation."""
    if name.startswith("agent-") and name != f"agent-{VICTIM}":
        data["workers"]["count"] = 1
    elif name == "job":
        data["evaluation"] = {"where": "none"}


def workers_dir(fed: FederationRun, region: str) -> Path:
    return fed.work / "agents" / region / "workers"


def training(fed: FederationRun, region: str, round_: int) -> bool:
    """The region's workers hold round ``round_``'s instruction and have not finished it."""
    jobs = workers_dir(fed, region) / "jobs" / fed.job
    return (jobs / f"round-{round_}.instruction.json").exists() and not (
        jobs / f"round-{round_}.done.json"
    ).exists()


def rank_status(fed: FederationRun, region: str, rank: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        (workers_dir(fed, region) / "ranks" / f"rank-{rank}.json").read_text()
    )
    return data


def agent_pids(fed: FederationRun) -> dict[str, int | None]:
    """The live agent processes: name -> pid (None once exited)."""
    return {
        c.name: c.pid if c.returncode is None else None
        for c in fed.children.children
        if c.name.startswith("agent-")
    }


async def test_worker_killed_mid_round_is_restarted_and_the_region_loses_no_round(
    tmp_path: Path,
) -> None:
    async with observed_federation(
        tmp_path,
        regions=REGIONS,
        rounds=ROUNDS,
        inner_steps=INNER_STEPS,
        customize=configure,
        ranks=None,
    ) as (fed, observer):
        await poll(
            fed,
            lambda: training(fed, VICTIM, KILLED_ROUND),
            f"{VICTIM} to train round {KILLED_ROUND}",
            timeout_s=WAIT_S,
        )
        agents_before = agent_pids(fed)
        rank0 = rank_status(fed, VICTIM, 0)
        assert rank0["restart_count"] == 0, rank0
        killed_at = time.monotonic()
        os.kill(rank0["pid"], signal.SIGKILL)
        still_training = training(fed, VICTIM, KILLED_ROUND)

        await poll(
            fed,
            lambda: (
                rank_status(fed, VICTIM, 0)["restart_count"] >= 1
                and rank_status(fed, VICTIM, 0)["state"] == "ready"
            ),
            "the worker group to be restarted",
        )
        assert not alive(rank0["pid"])
        restarted = rank_status(fed, VICTIM, 0)
        assert restarted["launch_id"] == rank0["launch_id"]  # in place, by the launcher
        await poll(fed, lambda: bool(observer.accepted(VICTIM, KILLED_ROUND)), "the delta")
        accepted_at = observer.accepted(VICTIM, KILLED_ROUND)[-1][0]

        final = await fed.wait_for(
            lambda job: job.get("state") == "completed",
            timeout_s=WAIT_S,
            what="the job to complete",
        )
        agents_after = agent_pids(fed)
        agent_text = await agent_metrics(fed, VICTIM)
        entries = await audit_entries(fed, job=fed.job, verify=True)
        await check_same_parameters(
            fed, observer, ROUNDS, {region: set(range(ROUNDS)) for region in REGIONS}
        )

    assert still_training, "the kill landed after the round had finished"
    assert final["round"] == ROUNDS
    # The agent process lived on (the same one throughout) and saw the restart.
    assert agents_after == agents_before
    assert sample(agent_text, "geofed_agent_worker_restarts_total", region=VICTIM) >= 1
    reported = [s.worker_restarts for _, s in observer.statuses if s.region == VICTIM]
    assert max(reported) >= 1, reported
    assert (
        "worker group restarted by its launcher"
        in (tmp_path / "logs" / f"agent-{VICTIM}.log").read_text()
    )
    # The new rank 0 took the inner optimizer state and data cursor of the round before.
    rank_log = (workers_dir(fed, VICTIM) / "logs" / "rank-0.log").read_text()
    assert f"resumed from the regional checkpoint of round {KILLED_ROUND - 1}" in rank_log

    # No round lost, none applied twice: one accepted delta per region and round.
    accepts = sorted((e.round, e.region) for e in entries if e.action == "delta.accept")
    assert accepts == [(r, g) for r in range(ROUNDS) for g in sorted(REGIONS)]
    assert [e.round for e in entries if e.action == "round.publish"] == list(range(ROUNDS))
    lost = ROUNDS - sum(1 for r, g in accepts if g == VICTIM)
    print(
        f"\nworker kill: rank 0 of {VICTIM} killed in round {KILLED_ROUND}; rounds lost: {lost}; "
        f"kill to accepted delta {accepted_at - killed_at:.1f} s"
    )
