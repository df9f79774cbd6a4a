"""``overlap: delayed`` with ``overlap_start: eager`` in a real federation (embedded
broker, coordinator and two agents as processes, mutual TLS, real worker groups).

What it proves: the coordinator sends the job's outer optimizer config to the regions;
each region, having trained round r, hands its workers the eager estimate S of θ_{r+1}
(replaying the outer optimizer from the published θs from round 1 on), the workers start
every round after the first from S, fold θ_{r+1} in when it comes, and every region still
ends every round holding exactly the coordinator's θ.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.federation import FederationRun
from tests.support.observe import (
    WAIT_S,
    audit_entries,
    check_same_parameters,
    observed_federation,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REGIONS = ("eu-west", "us-east")
ROUNDS = 3
INNER_STEPS = 12
_FROM_S = re.compile(
    r"job (\S+) round (\d+): starting from the eager estimate S ([0-9a-f]{64}) "
    r"\(([0-9.]+) s waited for it\)"
)
_HANDED = re.compile(
    r"job (\S+): round (\d+) starts from the eager estimate \(outer optimizer (\w+)"
)


def configure(name: str, data: dict[str, Any]) -> None:
    """An eager delayed job; two workers in eu-west (DDP), one in us-east (few cores here)."""
    if name == "job":
        data["overlap"] = "delayed"
        data["overlap_start"] = "eager"
    if name == "agent-us-east":
        data["workers"]["count"] = 1


def _log(fed: FederationRun, *parts: str) -> str:
    return fed.work.joinpath(*parts).read_text(errors="replace")


def started_from_s(fed: FederationRun, region: str) -> dict[int, float]:
    """Round -> seconds waited for S, of the rounds rank 0 started from the estimate."""
    text = _log(fed, "agents", region, "workers", "logs", "rank-0.log")
    return {
        int(m.group(2)): float(m.group(4)) for m in _FROM_S.finditer(text) if m.group(1) == fed.job
    }


def handed(fed: FederationRun, region: str) -> dict[int, str]:
    """Round -> how the agent had its replica (``replayed`` or ``replica``: at zero)."""
    text = _log(fed, "logs", f"agent-{region}.log")
    return {int(m.group(2)): m.group(3) for m in _HANDED.finditer(text) if m.group(1) == fed.job}


async def test_eager_rounds_start_from_the_estimate_and_agree_with_the_coordinator(
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
        final = await fed.wait_completed(timeout_s=WAIT_S)
        entries = await audit_entries(fed, job=fed.job, verify=True)
        await check_same_parameters(
            fed, observer, ROUNDS, {region: set(range(ROUNDS)) for region in REGIONS}
        )
        from_s = {region: started_from_s(fed, region) for region in REGIONS}
        hand = {region: handed(fed, region) for region in REGIONS}

    assert final["round"] == ROUNDS
    assert all(a.overlap_start == "eager" for a in observer.announcements)
    assert all(a.outer_optimizer is not None for a in observer.announcements)
    accepts = sorted((e.round, e.region) for e in entries if e.action == "delta.accept")
    assert accepts == [(r, g) for r in range(ROUNDS) for g in sorted(REGIONS)]
    for region in REGIONS:
        # Round 0 starts from θ_0; every later round from the agent's estimate S.
        assert sorted(from_s[region]) == list(range(1, ROUNDS)), (region, from_s[region])
        assert all(wait >= 0.0 for wait in from_s[region].values())
        # S of round 1 comes from a replica at zero (no outer step seen yet); from round 2
        # on the agent replays the coordinator's steps.
        assert hand[region] == {1: "replica", **dict.fromkeys(range(2, ROUNDS), "replayed")}, (
            region,
            hand[region],
        )
