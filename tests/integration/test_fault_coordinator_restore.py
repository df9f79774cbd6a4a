"""The coordinator restored from an older backup: the regions follow it back by themselves.

A real federation (embedded broker, coordinator and two agents as processes, mutual TLS,
SQLite), two regions and a quorum of two. The coordinator is stopped once θ_1 is
published, its state (database, blobs, checkpoint chains) copied as a backup, and
started again; the federation goes on to θ_3. Then the coordinator is killed, its state
replaced by the backup, and started again: it announces round 1 while both regions hold
θ_3 or θ_2 (or, when the backup already holds both round-1 deltas, publishes θ_2 from
them at once and announces round 2).

What it proves: each region's agent confirms the rollback with the coordinator, says so
once in its log, discards its state of the job (θ, residual, progress, the worker
group's regional checkpoint) and resyncs; the job completes, every round after the
backup is trained again, and both regions end on the coordinator's last parameters.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.support.federation import FederationRun, running_federation

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REGIONS = ("eu-west", "us-east")
ROUNDS = 5
BACKUP_ROUND = 1
REACHED_ROUND = BACKUP_ROUND + 2


def rollbacks(log: str) -> list[tuple[int, int]]:
    """The (from, to) rounds of every rollback warning in an agent's log."""
    found = re.findall(
        r"coordinator rolled back from round (\d+) to (\d+); "
        r"discarding local job state and resyncing",
        log,
    )
    return [(int(a), int(b)) for a, b in found]


def state_dirs(fed: FederationRun) -> tuple[Path, Path]:
    """What the coordinator's state is: its state directory and its checkpoint storage."""
    return fed.work / "coordinator", fed.work / "checkpoints"


def job_dir(fed: FederationRun, region: str) -> Path:
    return fed.work / "agents" / region / "jobs" / fed.job


def held(fed: FederationRun, region: str) -> dict[str, object]:
    data = json.loads((job_dir(fed, region) / "params" / "current.json").read_text())
    return {"round": data["round"], "hash": data["hash"]}


def reached(fed: FederationRun, region: str) -> int:
    """The latest round the region's state records: the θ held, the last delta delivered."""
    progress = json.loads((job_dir(fed, region) / "progress.json").read_text())
    return max(int(str(held(fed, region)["round"])), int(progress["uploaded_round"]))


def agent_log(fed: FederationRun, region: str) -> str:
    return (fed.children.log_dir / f"agent-{region}.log").read_text(errors="replace")


async def test_agents_follow_a_coordinator_restored_from_an_older_backup(
    tmp_path: Path,
) -> None:
    backup = tmp_path / "backup"
    async with running_federation(
        tmp_path / "fed", regions=REGIONS, rounds=ROUNDS, inner_steps=10
    ) as fed:
        status, body = await fed.submit()
        assert status == 201, body
        await fed.wait_round(BACKUP_ROUND)

        # A backup with the coordinator stopped (docs/operations.md: a consistent copy).
        await fed.kill("coordinator", signal.SIGTERM)
        for part in state_dirs(fed):
            shutil.copytree(part, backup / part.name, symlinks=True)
        await fed.restart("coordinator")
        await fed.wait_round(REACHED_ROUND)

        await fed.kill("coordinator", signal.SIGKILL)
        # Both delivered round 2 (θ_3 needs both); a fast round may have gone one further
        # before the kill; each region may or may not hold the last θ yet.
        ahead = {region: reached(fed, region) for region in REGIONS}
        assert all(REACHED_ROUND - 1 <= a < ROUNDS for a in ahead.values()), ahead
        for part in state_dirs(fed):
            shutil.rmtree(part)
            shutil.copytree(backup / part.name, part, symlinks=True)
        restored_at = time.monotonic()
        await fed.restart("coordinator")
        restored = await fed.status()
        assert int(restored["round"]) == BACKUP_ROUND, restored

        first = await fed.wait_round(BACKUP_ROUND + 1, timeout_s=120.0)
        first_round_s = time.monotonic() - restored_at
        final = await fed.wait_completed(timeout_s=240.0)
        completed_s = time.monotonic() - restored_at
        assert int(first["round"]) >= BACKUP_ROUND + 1, first
        assert int(final["round"]) == ROUNDS, final

        # θ_{r+1} as the restored coordinator published it (the last publication of r).
        page = await fed.get(f"/v1/audit?job={fed.job}&limit=1000")
        theta = {
            int(e["round"]) + 1: str(e["details"]["params_hash"])
            for e in page["entries"]
            if e["action"] == "round.publish"
        }
        assert theta[ROUNDS] == final["params_hash"], (theta, final)
        regions = {r["region"]: r for r in (await fed.get("/v1/regions"))["regions"]}
        resent: dict[str, int] = {}
        for region in REGIONS:
            # Both trained the last round from the coordinator's θ, and say so.
            assert held(fed, region) == {"round": ROUNDS - 1, "hash": theta[ROUNDS - 1]}, region
            assert regions[region]["params_hash"] == theta[ROUNDS - 1], regions[region]
            log = agent_log(fed, region)
            # Deltas delivered just before the backup was taken are in the backup: the
            # restored coordinator keeps them (acknowledged work) and may publish θ_2 from
            # them before the agents notice, so an agent may roll back to round 1 or 2.
            seen = rollbacks(log)
            assert len(seen) == 1, (region, seen, log[-4000:])
            assert log.count("coordinator rolled back") == 1, (region, log[-4000:])
            (start, to) = seen[0]
            assert start == ahead[region], (region, ahead, seen)
            assert BACKUP_ROUND <= to < start, (region, seen)
            after = log[log.index(f"coordinator rolled back from round {start} to {to}") :]
            sent = [int(n) for n in re.findall(r"delta accepted \(\d+ chunks, (\d+) bytes", after)]
            # Every round from there on was delivered again, once; a delta the restored
            # coordinator already held is refused and its own kept.
            kept = f"rounds/{to}/deltas/{region}/manifest: HTTP 409 already_accepted"
            assert len(sent) + (kept in after) == ROUNDS - to, (region, seen, sent)
            resent[region] = sum(sent)
        print(
            f"\nrestored at θ_{BACKUP_ROUND}, regions at {ahead}: θ_{BACKUP_ROUND + 1} again "
            f"{first_round_s:.1f} s and θ_{ROUNDS} {completed_s:.1f} s after the restart; "
            f"{max(ahead.values()) - BACKUP_ROUND} rounds lost; delta bytes sent after the "
            f"rollback {resent}"
        )
