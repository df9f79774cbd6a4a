"""A region removed while the coordinator opens a round (real TLS, SQLite, Mosquitto).

Opening a round chooses its participants, then reads the round's receipts and records
the round in the state store before announcing it. A removal that arrives in between
must wait for the next round boundary, as it does once the round is recorded: the round
keeps the participants it was opened with and is announced, the job does not fail. The
state store is made to stall on that read (the fault injected), so the removal lands in
exactly that window.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from coordinator.api.keys import SERVICES
from tests.support.coordinator import (
    JOB,
    FakeRegion,
    coordinator,
    job_yaml,
    mosquitto_setup,
    request,
    wait_collecting,
)

pytestmark = [pytest.mark.integration]

REGIONS = ("eu-west", "us-east", "ap-south")
LEAVING = "ap-south"


def three_region_job() -> str:
    text = job_yaml(rounds=3, deadline=30, extra="min_regions: 2\nmax_regions: 3\n")
    return text.replace(
        "  us-east: [us-public-domain-books]\n",
        "  us-east: [us-public-domain-books]\n  ap-south: [in-indic-wikipedia]\n",
    )


class StalledReceipts:
    """The state store's receipt listing for one round, held until released (the
    store's own thread stays free: other requests reach the store meanwhile)."""

    def __init__(self, listing: Callable[[str, int], Awaitable[Any]], round_: int) -> None:
        self._listing = listing
        self._round = round_
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, job_id: str, round: int) -> Any:
        if round == self._round and not self.entered.is_set():
            self.entered.set()
            async with asyncio.timeout(30):
                await self.release.wait()
        return await self._listing(job_id, round)


async def deliver(
    regions: dict[str, FakeRegion], names: tuple[str, ...], round_: int, base: str
) -> None:
    for seed, name in enumerate(names):
        manifest, stream = regions[name].delta(JOB, round_, base, seed=seed)
        status, body = await regions[name].single_shot(JOB, round_, manifest, stream)
        assert (status, body["state"]) == (200, "accepted"), body


async def test_a_removal_while_a_round_opens_waits_for_the_next_boundary(
    tmp_path: Path,
) -> None:
    with mosquitto_setup(tmp_path) as setup:
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            observer = running.session(setup.observer)
            status, body = await request(operator, "POST", "/v1/jobs", data=three_region_job())
            assert status == 201, body
            base = (await wait_collecting(observer, 0))["params_hash"]
            regions = {name: running.region(name) for name in REGIONS}

            db: Any = running.runner.app[SERVICES].db
            stall = StalledReceipts(db.list_receipts, 1)
            db.list_receipts = stall
            await deliver(regions, REGIONS, 0, base)
            # Round 0 is published; round 1's participants are chosen, its receipts read.
            async with asyncio.timeout(30):
                await stall.entered.wait()
            status, body = await request(
                operator, "POST", f"/v1/jobs/{JOB}/regions", json={"remove": LEAVING}
            )
            stall.release.set()
            assert status == 202, body
            assert (body["effective"], body["round_in_progress"]) == ("next_round", 1), body
            assert "round 1 in progress keeps its participants" in body["reason"], body

            job = await wait_collecting(observer, 1)
            assert job["state"] == "running", job
            assert job["current"]["participants"] == sorted(REGIONS), job
            await deliver(regions, REGIONS, 1, job["params_hash"])
            job = await wait_collecting(observer, 2)
            assert job["current"]["participants"] == ["eu-west", "us-east"], job
            assert job["shards"]["left"] == [LEAVING], job
