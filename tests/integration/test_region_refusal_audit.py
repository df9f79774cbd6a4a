"""A region whose agent does not train on a dataset the job names for it refuses the job's
rounds itself, and the coordinator's audit log says so.

A real federation (embedded broker, coordinator and two agents as processes, mutual TLS):
eu-west's agent config trains on eu-support-chats only, while the job assigns it
eu-parliament-proceedings (its policy declares both, so the coordinator admits the job).
eu-west refuses round 0 before anything trains, its status names the dataset, and the
coordinator appends a ``round.refuse`` entry with the region as actor and the reason
(once however often the status repeats: ``tests/unit/test_region_refusals.py``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.support.observe import audit_entries, observed_federation, poll

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REGIONS = ("eu-west", "us-east")


def configure(name: str, data: dict[str, Any]) -> None:
    if name == "job":
        data["regions"]["eu-west"] = ["eu-parliament-proceedings"]
    if name == "agent-eu-west":
        data["datasets"] = ["eu-support-chats"]


async def test_a_round_a_region_refuses_itself_is_audited(tmp_path: Path) -> None:
    async with observed_federation(
        tmp_path, regions=REGIONS, rounds=2, inner_steps=3, customize=configure
    ) as (fed, observer):

        def refused() -> bool:
            return any(
                s.region == "eu-west" and s.refused and s.job == fed.job
                for _, s in observer.statuses
            )

        await poll(fed, refused, "eu-west to refuse the job's round")

        async def refusals() -> list[Any]:
            return [e for e in await audit_entries(fed, job=fed.job) if e.action == "round.refuse"]

        async with asyncio.timeout(20):
            while not (entries := await refusals()):  # noqa: ASYNC110 - the audit log has no event
                await asyncio.sleep(0.2)
    [entry] = entries
    assert (entry.region, entry.round, entry.verdict) == ("eu-west", 0, "deny")
    assert entry.actor.endswith("/region/eu-west")
    reason = entry.details["reason"]
    assert "trains region eu-west on eu-parliament-proceedings, which this agent does not" in (
        reason
    )
    assert "(its datasets: eu-support-chats)" in reason
