"""The coordinator restored from an older backup: the regions follow it back by themselves.

A real federation (embedded broker, coordinator and two agents as processes, mutual TLS,
SQLite), two regions, a quorum of two and nothing evaluated (``evaluation: none``: no
assertion here looks at a loss). The coordinator is stopped once θ_1 is
published, its state (database, blobs, checkpoint chains) copied as a backup, and
started again; the federation goes on two rounds past the backup's. Then the coordinator
is killed, its state replaced by the backup, and started again: it announces the backup's
round (1, or 2 when a round was published between the test's look and the stop) while
both regions are one or two rounds ahead (or, when the backup already holds every
region's delta of that round, publishes from them at once and announces the next).

What it proves: each region's agent confirms the rollback with the coordinator, says so
once in its log, discards its state of the job (θ, residual, progress, the worker
group's regional checkpoint) and resyncs; the job completes, every round after the
backup is trained again, and both regions end on the coordinator's last parameters.

A restarted coordinator serves before its job is read back: an upload that comes in
meanwhile (a region retrying across the restart) is answered 503, which a region retries,
never as a closed round, which would make it a straggler of the very round recovered open;
and it is not ready until then. A coordinator daemon (real process, Mosquitto with mutual
TLS) is held there by its ``recover`` fault point (:mod:`coordinator.faults`); the test
plays the region (``FakeRegion``).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from coordinator.state.sqlite import SqliteStore
from coordinator.storage.working_state import VERSION
from tests.support.coordinator import JOB, job_yaml, request
from tests.support.coordinator_daemon import daemon_with_broker
from tests.support.federation import FederationRun, running_federation
from tests.support.pki import make_federation

pytestmark = pytest.mark.integration

REGIONS = ("eu-west", "us-east")
# One round more than the two past the backup that the test needs: the backup may be a
# round later than BACKUP_ROUND, and a fast round may go one further before the kill.
ROUNDS = 6
BACKUP_ROUND = 1
#: Inner steps per round: a round is short, and the test allows for one that outruns a
#: look and a stop (the backup a round later, a region a round further at the kill).
INNER_STEPS = 3


def configure(name: str, data: dict[str, Any]) -> None:
    """No evaluation."""
    if name == "job":
        data["evaluation"] = {"where": "none"}


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


def backup_round(backup: Path, job: str) -> tuple[int, int]:
    """The round the backup's coordinator state is at, and how many deltas of it it holds."""
    store = SqliteStore.in_state_dir(backup)
    try:
        version = store.get_pointer(job, VERSION)
        assert version is not None, f"no θ recorded in {backup}"
        return int(version), len(store.list_receipts(job, int(version)))
    finally:
        store.close()


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


async def test_an_upload_while_the_job_is_read_back_is_retried_not_closed(
    tmp_path: Path,
) -> None:
    fed = make_federation(tmp_path / "fed", "acme")
    async with daemon_with_broker(tmp_path / "restarted", fed) as daemon:
        await daemon.start()
        await daemon.submit()
        job = await daemon.wait_job("round 0 to collect", collecting)
        await daemon.kill()

        # Restarted with its job engine held just before it reads the job back (the
        # ``recover`` fault point, released by removing its marker).
        await daemon.start(fault="recover", wait_ready=False)
        await daemon.wait_marker("recover", 0)
        region = daemon.region("eu-west")
        observer = daemon.session(daemon.setup.observer)
        manifest, stream = region.delta(JOB, 0, job["params_hash"], seed=1)
        status, body = await region.three_step(JOB, 0, manifest, stream)
        assert (status, body["error"]) == (503, "unavailable"), body
        # Not ready either: a load balancer sends no region here before the job is back.
        ready, readiness = await request(observer, "GET", "/readyz")
        assert ready == 503, readiness
        assert readiness["checks"]["jobs"] == f"recovering: {JOB}", readiness

        (daemon.state_dir / f"fault-recover-{JOB}-0").unlink()
        await daemon.wait_ready()
        ready, readiness = await request(observer, "GET", "/readyz")
        assert (ready, readiness["checks"]["jobs"]) == (200, "ok"), readiness
        await daemon.wait_job("round 0 to collect again", collecting)
        status, body = await region.three_step(JOB, 0, manifest, stream)
        assert (status, body["state"]) == (200, "accepted"), body


async def test_a_region_that_joined_uploading_while_the_job_is_read_back_is_told_to_retry(
    tmp_path: Path,
) -> None:
    """Until its job is read back, a restarted coordinator knows the regions the job was
    submitted with: us-east, which joined later, must be told to retry (503), not that the
    job does not exist (404, on which a region drops its round)."""
    fed = make_federation(tmp_path / "fed", "acme")
    async with daemon_with_broker(tmp_path / "joined", fed) as daemon:
        await daemon.start()
        operator = daemon.session(daemon.setup.operator)
        alone = job_yaml(rounds=3, extra="min_regions: 1\nmax_regions: 2\n").replace(
            "  us-east: [us-public-domain-books]\n", ""
        )
        status, body = await request(operator, "POST", "/v1/jobs", data=alone)
        assert status == 201, body
        joined = {"add": "us-east", "datasets": ["us-public-domain-books"]}
        status, body = await request(operator, "POST", f"/v1/jobs/{JOB}/regions", json=joined)
        assert status in (200, 202), body
        job = await daemon.wait_job("round 0 to collect", collecting)
        eu_west = daemon.region("eu-west")
        manifest, stream = eu_west.delta(JOB, 0, job["params_hash"], seed=1)
        status, body = await eu_west.three_step(JOB, 0, manifest, stream)
        assert (status, body["state"]) == (200, "accepted"), body

        def with_us_east(s: dict[str, Any]) -> bool:
            current = s.get("current") or {}
            return current.get("phase") == "collecting" and "us-east" in current["participants"]

        job = await daemon.wait_job("a round on us-east", with_us_east)
        await daemon.kill()

        await daemon.start(fault="recover", wait_ready=False)
        await daemon.wait_marker("recover", 0)
        us_east = daemon.region("us-east")
        manifest, stream = us_east.delta(JOB, job["round"], job["params_hash"], seed=2)
        status, body = await us_east.three_step(JOB, job["round"], manifest, stream)
        assert (status, body["error"]) == (503, "unavailable"), body

        (daemon.state_dir / f"fault-recover-{JOB}-0").unlink()
        await daemon.wait_ready()
        status, body = await us_east.three_step(JOB, job["round"], manifest, stream)
        assert (status, body["state"]) == (200, "accepted"), body


def collecting(status: dict[str, Any]) -> bool:
    return bool(status["round"] == 0 and status.get("current", {}).get("phase") == "collecting")


@pytest.mark.slow
async def test_agents_follow_a_coordinator_restored_from_an_older_backup(
    tmp_path: Path,
) -> None:
    backup = tmp_path / "backup"
    async with running_federation(
        tmp_path / "fed",
        regions=REGIONS,
        rounds=ROUNDS,
        inner_steps=INNER_STEPS,
        customize=configure,
    ) as fed:
        status, body = await fed.submit()
        assert status == 201, body
        await fed.wait_round(BACKUP_ROUND)

        # A backup with the coordinator stopped (docs/operations.md: a consistent copy).
        await fed.kill("coordinator", signal.SIGTERM)
        for part in state_dirs(fed):
            shutil.copytree(part, backup / part.name, symlinks=True)
        # The round the backup holds, not the one the poll saw: rounds are quick, and one
        # more may be published between the poll and the stop.
        at, delivered = backup_round(backup / "coordinator", fed.job)
        assert at + 3 < ROUNDS, f"backup at round {at}: no room left for the scenario"
        reached_round = at + 2
        await fed.restart("coordinator")
        await fed.wait_round(reached_round)

        await fed.kill("coordinator", signal.SIGKILL)
        # Both delivered round at + 1 (θ_{at + 2} needs both); a fast round may have gone
        # one further before the kill; each region may or may not hold the last θ yet.
        ahead = {region: reached(fed, region) for region in REGIONS}
        assert all(reached_round - 1 <= a < ROUNDS for a in ahead.values()), ahead
        # The agents still run: one that had fetched the last θ before the kill may record
        # it only after this look, never a round past what the killed coordinator reached.
        killed_at, _ = backup_round(state_dirs(fed)[0], fed.job)
        for part in state_dirs(fed):
            shutil.rmtree(part)
            shutil.copytree(backup / part.name, part, symlinks=True)
        restored_at = time.monotonic()
        await fed.restart("coordinator")
        # Ready (/readyz) is not recovered: until its engine has read the job back, the
        # coordinator shows the job at round 0, which no backup here is at.
        restored = await fed.wait_round(1, timeout_s=60.0)
        # It starts from the backup's θ; holding every region's delta of that round, it
        # may have published the next one by the time it answers.
        started = {at, at + 1} if delivered == len(REGIONS) else {at}
        assert int(restored["round"]) in started, (restored, at, delivered)

        first = await fed.wait_round(at + 1, timeout_s=120.0)
        first_round_s = time.monotonic() - restored_at
        final = await fed.wait_for(
            lambda job: job.get("state") == "completed", timeout_s=240.0, what="the job to complete"
        )
        completed_s = time.monotonic() - restored_at
        assert int(first["round"]) >= at + 1, first
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
            # restored coordinator keeps them (acknowledged work) and may publish θ_{at+1}
            # from them before the agents notice, so an agent may roll back to round at or
            # at + 1; to the very round it was at when its delta of that round is lost.
            seen = rollbacks(log)
            assert len(seen) == 1, (region, seen, log[-4000:])
            assert log.count("coordinator rolled back") == 1, (region, log[-4000:])
            (start, to) = seen[0]
            assert ahead[region] <= start <= killed_at, (region, ahead, killed_at, seen)
            assert at <= to <= at + 1, (region, at, seen)
            # Back to the very round it was at only when its delta of that round is lost.
            assert to < start or start == at + 1, (region, at, seen)
            after = log[log.index(f"coordinator rolled back from round {start} to {to}") :]
            sent = [int(n) for n in re.findall(r"delta accepted \(\d+ chunks, (\d+) bytes", after)]
            # Every round from there on was delivered again, once; a delta the restored
            # coordinator already held is refused and its own kept.
            kept = f"rounds/{to}/deltas/{region}/manifest: HTTP 409 already_accepted"
            assert len(sent) + (kept in after) == ROUNDS - to, (region, seen, sent)
            resent[region] = sum(sent)
        print(
            f"\nrestored at θ_{at}, regions at {ahead}: θ_{at + 1} again "
            f"{first_round_s:.1f} s and θ_{ROUNDS} {completed_s:.1f} s after the restart; "
            f"{max(ahead.values()) - at} rounds lost; delta bytes sent after the "
            f"rollback {resent}"
        )
