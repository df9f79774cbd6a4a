"""The adaptive snapshot interval, with real processes.

A coordinator and two agents (embedded broker, mTLS). A job with ``snapshot_every:
auto`` (bounds 2..4) has no snapshot cost measured at first: it takes its shortest
interval, so θ_2 is snapshotted and its cost measured; with no failure observed it then
takes its longest (4). eu-west's agent is killed (its process group; the broker publishes
its Will) and started again: the job's status cites the measured MTBF and the interval
drops to the minimum. The chain on disk holds exactly the snapshots the policy chose,
the status said what it planned, and the metric shows the interval.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from coordinator.storage.checkpoints import CheckpointStore, EntryKind
from geofed.blobstore import FsBlobStore
from tests.support.federation import FederationRun, running_federation
from tests.support.observe import sample

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROUNDS = 6
#: Rounds of a few seconds: the test sees θ_2 and kills eu-west well before round 2 ends.
INNER_STEPS = 40
KILLED = "eu-west"


async def poll(
    fed: FederationRun, predicate: Callable[[dict[str, Any]], bool], timeout_s: float, what: str
) -> dict[str, Any]:
    """The job's status once ``predicate`` holds (an agent may be down meanwhile)."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        last = await fed.status()
        if predicate(last):
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last status {last}\n{fed.log_tails()}")


def snapshot_rounds(fed: FederationRun, location: str) -> list[int]:
    root = fed.work / "checkpoints" / location
    store = CheckpointStore(location, root, blobs=FsBlobStore(root / "blobs"))
    return [e.round for e in store.entries(fed.job) if e.kind is EntryKind.SNAPSHOT]


async def test_the_interval_adapts_to_the_measured_cost_and_failures(tmp_path: Path) -> None:
    async with running_federation(
        tmp_path, regions=("eu-west", "us-east"), rounds=ROUNDS, inner_steps=INNER_STEPS
    ) as fed:
        spec: dict[str, Any] = {
            **fed.job_spec(),
            "snapshot_every": "auto",
            "snapshot_min_rounds": 2,
            "snapshot_max_rounds": 4,
            # No evaluations, so no loss trend stretches the interval: it follows the
            # measured cost and failures alone (the stretch: tests/unit/test_loss_trend.py).
            "evaluation": {"where": "none"},
        }
        spec.pop("retention", None)
        status, body = await fed.submit(spec)
        assert status == 201, body
        first = body.get("snapshot") or (await fed.status())["snapshot"]
        assert (first["mode"], first["every_rounds"]) == ("auto", 2), first
        assert "no snapshot cost measured yet" in first["reason"], first

        # θ_2's snapshot measured the cost; no failure yet: the longest interval.
        measured = await poll(
            fed, lambda s: s["snapshot"]["last_round"] == 2, 120, "θ_2's snapshot"
        )
        plan = measured["snapshot"]
        assert plan["every_rounds"] == 4, plan
        assert "no failures measured yet" in plan["reason"], plan
        assert plan["cost_s"] > 0, plan
        assert plan["mtbf_s"] is None, plan
        assert plan["next_round"] == 6, plan
        location = measured["checkpoint_location"]
        assert snapshot_rounds(fed, location) == [0, 2]
        assert (
            sample(await fed.metrics_text(), "geofed_job_snapshot_interval_rounds", job=fed.job)
            == 4
        )

        # eu-west fails while it serves the job; the round cannot end without it.
        await fed.kill(f"agent-{KILLED}")
        failed = await poll(
            fed, lambda s: "measured MTBF" in s["snapshot"]["reason"], 60, "the failure"
        )
        plan = failed["snapshot"]
        assert f"{KILLED}: 1 in" in plan["reason"], plan
        assert "went offline" in plan["reason"], plan
        assert plan["mtbf_s"] > 0, plan
        assert plan["tau_s"] is not None, plan
        # τ = √(2·δ·M) is far below a round here: the job's minimum.
        assert plan["every_rounds"] == 2, plan
        assert "raised to the job's minimum 2" in plan["reason"], plan
        assert failed["round"] == 2, failed  # round 2 waits for eu-west
        await fed.restart(f"agent-{KILLED}")

        final = await fed.wait_for(
            lambda s: s.get("state") == "completed", timeout_s=150, what="the job to complete"
        )
        # θ_3 came 1 round after θ_2 (no snapshot under either interval); from θ_4 on
        # every 2nd round: the chain holds exactly the chosen rounds.
        assert snapshot_rounds(fed, location) == [0, 2, 4, 6]
        done = final["snapshot"]
        assert (done["last_round"], done["every_rounds"]) == (6, 2), done
        assert "measured MTBF" in done["reason"], done
