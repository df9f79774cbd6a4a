"""``overlap: delayed`` in a real federation (embedded broker, coordinator and two agents as
processes, mutual TLS, real worker groups).

What it proves: regions train round r+1 before θ_{r+1} exists anywhere (a round's
training starts before the coordinator announces that round), fold θ_{r+1} in when it
comes, and still end every round holding exactly the coordinator's θ; and a worker killed
with SIGKILL in the middle of such a round costs only that round's speculative steps. One
federation shows both: eu-west's rank 0 is killed in round 1, us-east trains undisturbed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.observe import (
    WAIT_S,
    audit_entries,
    check_same_parameters,
    observed_federation,
)
from tests.support.overlap_run import ahead, kill_rank0_ahead_of_theta, opened_at, workers_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REGIONS = ("eu-west", "us-east")
ROUNDS = 3
INNER_STEPS = 12


def configure(name: str, data: dict[str, Any]) -> None:
    """A delayed job; two workers in eu-west (DDP), one in us-east (few cores here)."""
    if name == "job":
        data["overlap"] = "delayed"
    if name == "agent-us-east":
        data["workers"]["count"] = 1


async def test_delayed_rounds_train_ahead_of_theta_agree_and_survive_a_killed_worker(
    tmp_path: Path,
) -> None:
    victim, killed_round = "eu-west", 1
    async with observed_federation(
        tmp_path,
        regions=REGIONS,
        rounds=ROUNDS,
        inner_steps=INNER_STEPS,
        customize=configure,
        ranks=None,
    ) as (fed, observer):
        await kill_rank0_ahead_of_theta(fed, victim, killed_round)
        final = await fed.wait_completed(timeout_s=WAIT_S)
        entries = await audit_entries(fed, job=fed.job, verify=True)
        await check_same_parameters(
            fed, observer, ROUNDS, {region: set(range(ROUNDS)) for region in REGIONS}
        )
        trained_ahead = {region: ahead(fed, region) for region in REGIONS}
        rank_log = (workers_dir(fed, victim) / "logs" / "rank-0.log").read_text()

    assert final["round"] == ROUNDS
    assert all(a.overlap == "delayed" for a in observer.announcements)
    accepts = sorted((e.round, e.region) for e in entries if e.action == "delta.accept")
    assert accepts == [(r, g) for r in range(ROUNDS) for g in sorted(REGIONS)]
    for region, rounds in trained_ahead.items():
        # Round 0 starts from θ_0; every later round was started from the local parameters,
        # but the victim's killed round (below).
        lost = {killed_round} if region == victim else set()
        assert sorted(rounds) == sorted(set(range(1, ROUNDS)) - lost), (region, rounds)
        for round_, (started_at, fold_step) in rounds.items():
            # Training began before θ_round was announced, so before it could be had.
            assert started_at < opened_at(observer, round_), (region, round_)
            assert 1 <= fold_step <= INNER_STEPS, (region, round_, fold_step)
    # The restarted group resumed from the regional checkpoint of the round before and
    # trained the killed round serially from θ; the next round went ahead of θ again.
    assert f"resumed from the regional checkpoint of round {killed_round - 1}" in rank_log
    assert f"job {fed.job} round {killed_round}: θ came; training from it" in rank_log
    assert killed_round + 1 in trained_ahead[victim]
