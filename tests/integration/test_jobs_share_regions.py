"""Two jobs sharing two regions, with the real daemons: every region keeps each job's
regional state apart (no job starts afresh after its first round), and once a job is done
its regional checkpoint is removed from the region's hand-off directory. The coordinator
keeps each job's working state apart too: the two jobs train alike, so their blobs are the
same bytes, and neither job's deletions take the other's."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from pathlib import Path

import pytest

from coordinator.state.sqlite import DB_FILENAME
from coordinator.storage.job_blobs import JobBlobStores
from coordinator.storage.working_state import ParamsStore
from regional_agent.handoff.directory import HandoffDir
from tests.support.federation import FederationRun, running_federation

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REGIONS = ("eu-west", "us-east")
JOBS = ("alpha", "beta")
ROUNDS = 3


def handoff(fed: FederationRun, region: str) -> HandoffDir:
    return HandoffDir(fed.work / "agents" / region / "workers")


async def wait_gone(fed: FederationRun, paths: list[Path], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(p.exists() for p in paths):
        fed.children.check_alive()
        if time.monotonic() > deadline:
            left = [str(p) for p in paths if p.exists()]
            raise AssertionError(f"still on disk after {timeout_s} s: {left}\n{fed.log_tails()}")
        await asyncio.sleep(0.3)


async def test_jobs_sharing_regions_keep_their_own_regional_state(tmp_path: Path) -> None:
    async with running_federation(tmp_path, regions=REGIONS, rounds=ROUNDS, inner_steps=3) as fed:
        spec = fed.job_spec()
        for job in JOBS:
            status, body = await fed.submit({**spec, "job": job})
            assert status == 201, body
        for job in JOBS:
            await fed.wait_for(
                lambda s: s.get("state") == "completed",
                timeout_s=300,
                what=f"job {job} to complete",
                job=job,
            )
        for region in REGIONS:
            log = handoff(fed, region).rank_log_path(0).read_text()
            for job in JOBS:
                # Each job's first round starts afresh, every later one resumes its own state.
                assert log.count(f"job {job}: fresh regional state") == 1, (region, job)
                assert f"job {job} round {ROUNDS - 1}:" in log, (region, job)
        # Done: the regions drop the jobs' regional checkpoints (disk stays bounded).
        await wait_gone(
            fed, [handoff(fed, r).checkpoint_path(job) for r in REGIONS for job in JOBS]
        )
        state_dir = fed.work / "coordinator"
        stores = JobBlobStores(state_dir)
        for job in JOBS:
            database = f"file:{state_dir / DB_FILENAME}?mode=ro"
            with contextlib.closing(sqlite3.connect(database, uri=True)) as db:
                rows = db.execute(
                    "SELECT name, value FROM pointers WHERE job_id = ?", (job,)
                ).fetchall()
            state = ParamsStore(stores.for_job(job)).load(dict(rows))
            assert state.version == ROUNDS, (job, state.version)
        assert stores.legacy_count() == 0
