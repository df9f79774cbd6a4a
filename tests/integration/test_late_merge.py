"""Late deltas merged into a later round, over real TLS, across coordinator restarts.

A job with ``aggregation.late: merge`` takes a straggler's delta into the round open when
it comes (once, whatever the retries), keeps it through a restart before that round is
published, sums it at its staleness weight when publishing, replays it after a restart
that must rebuild θ from the saved state, and refuses one staler than ``max_staleness``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from geofed.control.broker import EmbeddedBroker
from tests.support.coordinator import (
    Announcements,
    FakeRegion,
    audit_after,
    coordinator,
    job_yaml,
    metric_value,
    request,
    wait_collecting,
    write_setup,
)

pytestmark = pytest.mark.integration

MERGING = "min_regions: 1\naggregation: {late: merge, max_staleness: 1, grace_s: 1.0}\n"


async def _deliver(region: FakeRegion, round_: int, base: str, *, seed: int) -> dict[str, Any]:
    status, body = await region.single_shot(
        "tiny", round_, *region.delta("tiny", round_, base, seed=seed)
    )
    assert (status, body["state"]) == (200, "accepted"), body
    return body


def _accepts(entries: list[dict[str, Any]], round_: int, region: str) -> list[dict[str, Any]]:
    return [
        e
        for e in entries
        if e["action"] == "delta.accept" and e["round"] == round_ and e["region"] == region
    ]


def _publication(entries: list[dict[str, Any]], round_: int) -> dict[str, Any]:
    (found,) = [e for e in entries if e["action"] == "round.publish" and e["round"] == round_]
    details: dict[str, Any] = found["details"]
    return details


async def _status(observer: aiohttp.ClientSession) -> dict[str, Any]:
    status, body = await request(observer, "GET", "/v1/jobs/tiny")
    assert status == 200, body
    return body


async def test_a_late_delta_is_merged_once_survives_restarts_and_is_refused_when_stale(
    tmp_path: Path,
) -> None:
    async with EmbeddedBroker() as broker, Announcements(broker.port) as announcements:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            status, body = await request(
                operator, "POST", "/v1/jobs", data=job_yaml(rounds=6, extra=MERGING)
            )
            assert status == 201, body
            eu, us = running.region("eu-west"), running.region("us-east")
            base = (await announcements.until(round=0, state="open")).base_hash
            # Both at once: the round closes 1 s after the first.
            await asyncio.gather(_deliver(eu, 0, base, seed=1), _deliver(us, 0, base, seed=2))
            # Round 1: us-east is late; the round closes 1 s after eu-west's delta.
            base1 = (await announcements.until(round=1, state="open")).base_hash
            await _deliver(eu, 1, base1, seed=3)
            base2 = (await announcements.until(round=2, state="open")).base_hash
            late = us.delta("tiny", 1, base1, seed=4, tokens=300)
            status, merged = await us.three_step("tiny", 1, *late)
            assert (status, merged["state"]) == (200, "accepted"), merged
            assert merged["receipt"]["round"] == 1
            status, again = await us.single_shot("tiny", 1, *late)  # a retried upload
            assert (status, again["receipt"]) == (200, merged["receipt"]), again
            other = us.delta("tiny", 1, base1, seed=5)
            status, body = await us.single_shot("tiny", 1, *other)
            assert (status, body["error"]) == (409, "already_accepted"), body
            body = await _status(running.session(setup.observer))
            assert body["current"]["merged"] == [{"region": "us-east", "round": 1}]
            assert body["current"]["delivered"] == []
            merges = 'geofed_late_deltas_merged_total{job="tiny",region="us-east"}'
            assert await metric_value(running, running.session(setup.observer), merges) == 1.0
        # Restarted before round 2 is published: the merged delta is still in it.
        async with coordinator(setup) as running:
            observer = running.session(setup.observer)
            body = await wait_collecting(observer, 2)
            assert body["current"]["merged"] == [{"region": "us-east", "round": 1}]
            eu, us = running.region("eu-west"), running.region("us-east")
            status, again = await us.single_shot("tiny", 1, *late)
            assert (status, again["receipt"]) == (200, merged["receipt"]), again
            await asyncio.gather(_deliver(eu, 2, base2, seed=6), _deliver(us, 2, base2, seed=7))
            opened3 = await announcements.until(round=3, state="open")
        # Restarted after: θ_3 is rebuilt from θ_2's saved state by taking round 2 again,
        # its late delta included, and must hash as published.
        async with coordinator(setup) as running:
            observer = running.session(setup.observer)
            body = await wait_collecting(observer, 3)
            assert body["params_hash"] == opened3.base_hash
            eu, us = running.region("eu-west"), running.region("us-east")
            await _deliver(eu, 3, opened3.base_hash, seed=8)
            base4 = (await announcements.until(round=4, state="open")).base_hash
            await _deliver(eu, 4, base4, seed=9)
            await wait_collecting(observer, 5)
            # us-east's delta for round 3 now comes 2 rounds behind round 5: refused.
            stale = us.delta("tiny", 3, opened3.base_hash, seed=10)
            status, body = await us.single_shot("tiny", 3, *stale)
            assert (status, body["error"]) == (409, "round_closed"), body
            assert "2 rounds behind round 5" in body["message"]
            entries = await audit_after(observer, 0)
    (accepted,) = _accepts(entries, 1, "us-east")
    assert accepted["details"]["merged_into"] == 2
    assert accepted["details"]["staleness"] == 1
    assert _accepts(entries, 3, "us-east") == []
    first = _publication(entries, 1)
    assert (first["included"], first["stragglers"]) == (["eu-west"], ["us-east"])
    second = _publication(entries, 2)
    assert sorted(second["order"]) == ["eu-west", "us-east", "us-east@1"]
    assert second["tokens"] == 100 + 100 + 300  # a late delta's tokens reached θ
    for later in (3, 4):
        assert "us-east@1" not in _publication(entries, later)["order"]
