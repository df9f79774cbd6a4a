"""A full disk under a region's job state: the agent stays up and tries the round again.

eu-west's directory of the job (θ files, the spool, the residual) is a small tmpfs
(mounted for the test, a real filesystem that really runs out of space), filled while
round 0 trains, so spooling its delta fails with ENOSPC (or, if the round was quicker,
saving the next θ does). The agent reports the round's error with the reason and a
retry, leaves no partial delta behind, and keeps running (the daemon once exited on it,
and systemd restarted it until its limit). Once the test frees the disk, the retry
spools and sends the delta and the job completes with every region's delta of every round.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.disks import ENOSPC_TEXT, fill, tmpfs
from tests.support.observe import WAIT_S, check_others_alive, observed_federation, poll

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REGIONS = ("eu-west", "us-east")
ROUNDS = 2


async def test_a_full_spool_disk_is_retried_not_fatal(tmp_path: Path) -> None:
    job_dir = tmp_path / "agents" / "eu-west" / "jobs" / "charlm-demo"
    with tmpfs(job_dir, size="8m"):
        async with observed_federation(
            tmp_path, regions=REGIONS, rounds=ROUNDS, inner_steps=40
        ) as (fed, observer):

            def training() -> bool:
                return any(
                    s.region == "eu-west" and s.state == "training" for _, s in observer.statuses
                )

            def refused_for_space() -> bool:
                return any(
                    s.region == "eu-west" and s.state == "error" and ENOSPC_TEXT in s.detail
                    for _, s in observer.statuses
                )

            await poll(fed, training, "eu-west to train round 0")
            filler = fill(job_dir)
            await poll(fed, refused_for_space, "eu-west to report its full disk")
            [error] = {
                s.detail
                for _, s in observer.statuses
                if s.region == "eu-west" and s.state == "error" and ENOSPC_TEXT in s.detail
            } or {""}
            assert error.startswith("will retry: local storage:"), error
            # Nothing half-written stays in the spool.
            spooled = sorted((job_dir / "spool").glob("round-*/*"))
            assert all(
                p.name == "manifest.json" or p.with_name("manifest.json").exists() for p in spooled
            ), spooled
            check_others_alive(fed, killed=None)
            filler.unlink()
            final = await fed.wait_completed(timeout_s=WAIT_S)
            check_others_alive(fed, killed=None)

    assert final["round"] == ROUNDS
    for region in REGIONS:
        assert all(observer.accepted(region, r) for r in range(ROUNDS)), region
