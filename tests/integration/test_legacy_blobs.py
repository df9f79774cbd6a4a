"""Upgrading a state directory whose jobs shared one blob store, with the real daemon.

A job runs a round and has one delta of the next accepted; the coordinator is killed and
its jobs' blobs are put back the way earlier versions kept them (directly under
``state_dir/blobs/``). Restarted, the job adopts what it still needs into its own store
(its saved working state, the deltas kept for replay and of the open round) and
finishes: the replayed rounds reach θ's recorded hash, which the coordinator checks, so
the adopted blobs are the right ones. Then the shared store is removed
as the docs say it may be, and a restarted coordinator still finds the completed job
whole; and with its own blobs gone too, the job stays completed, its status saying why.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from coordinator.storage.job_blobs import JobBlobStores
from tests.support.coordinator_daemon import (
    JOB,
    ROUNDS,
    daemon_with_broker,
    deliver_one,
    log_text,
)
from tests.support.pki import make_federation

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def to_shared_layout(state_dir: Path) -> list[str]:
    """Move every job's blobs to where earlier versions kept them; their digests."""
    stores = JobBlobStores(state_dir)
    own = stores.for_job(JOB)
    moved = list(own.iter_digests())
    for digest in moved:
        target = stores.legacy.path_of(digest)
        target.parent.mkdir(exist_ok=True)
        own.path_of(digest).rename(target)
    shutil.rmtree(state_dir / "blobs" / "jobs")
    return moved


async def test_a_job_adopts_the_shared_stores_blobs_it_needs_and_completes(
    tmp_path: Path,
) -> None:
    fed = make_federation(tmp_path / "fed", "acme")
    async with daemon_with_broker(tmp_path / "upgraded", fed) as daemon:
        await daemon.start()
        await daemon.submit()
        await daemon.deliver(0)
        await daemon.wait_published(0)
        await deliver_one(daemon, 1, 0)  # round 1 open, one delta of it accepted
        await daemon.kill()
        moved = to_shared_layout(daemon.state_dir)
        # θ_0's working state (θ, the outer state; no residual yet), round 0's two deltas
        # kept for replay and round 1's one.
        assert len(moved) == 5, moved

        await daemon.start()
        assert f"job {JOB}: adopted 5 blob(s) of the shared store" in log_text(daemon)
        own = JobBlobStores(daemon.state_dir).for_job(JOB)
        assert all(own.path_of(digest).is_file() for digest in moved)
        await deliver_one(daemon, 1, 1)
        await daemon.wait_published(1)
        for round_ in range(2, ROUNDS):
            await daemon.deliver(round_)
            await daemon.wait_published(round_)
        job = await daemon.wait_job("the job to complete", lambda s: s["state"] == "completed")
        assert job["round"] == ROUNDS
        await daemon.kill()

        stores = JobBlobStores(daemon.state_dir)
        for fan in stores.legacy.root.iterdir():
            if len(fan.name) == 2:
                shutil.rmtree(fan)
        await daemon.start()
        job = await daemon.job()
        assert (job["state"], job["round"]) == ("completed", ROUNDS), job
        assert "working-state blob" not in log_text(daemon)

        # A completed job whose state cannot be read back stays completed, and says why.
        await daemon.kill()
        own = JobBlobStores(daemon.state_dir).for_job(JOB)
        for digest in list(own.iter_digests()):
            own.delete(digest)
        await daemon.start()
        job = await daemon.job()
        assert job["state"] == "completed", job
        assert "cannot be read back" in job["error"], job
