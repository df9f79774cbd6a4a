"""One region cannot dominate a round (real TLS, SQLite, Mosquitto).

Three regions of a job upload validly signed deltas; one of them sends its delta scaled
by 1000 or sign-flipped and scaled. Under ``aggregation: {rule: median}`` the published
update stays within the honest regions' range coordinate by coordinate (up to the
update's int8 rounding), where the plain mean would have moved θ by the attacker's
delta; under ``norm_check: refuse`` the round's audit entry names the region left out
and why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.coordinator import (
    JOB,
    FakeRegion,
    audit_after,
    coordinator,
    job_yaml,
    model_state,
    mosquitto_setup,
    request,
    wait_collecting,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HONEST = ("eu-west", "us-east")
ATTACKER = "ap-south"


def three_region_job(aggregation: str) -> str:
    extra = f"outer_optimizer: {{kind: average}}\naggregation: {aggregation}\n"
    text = job_yaml(rounds=2, deadline=30, extra=extra)
    return text.replace(
        "  us-east: [us-public-domain-books]\n",
        "  us-east: [us-public-domain-books]\n  ap-south: [in-indic-wikipedia]\n",
    )


def honest_delta(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: 0.01 * torch.randn(t.shape, generator=gen) for name, t in model_state().items()}


async def run_round(
    aggregation: str, attack: dict[str, torch.Tensor], tmp_path: Path
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Round 0 with two honest deltas and ``attack``; the honest deltas, the update and
    the round's audit entries."""
    with mosquitto_setup(tmp_path) as setup:
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            observer = running.session(setup.observer)
            status, body = await request(
                operator, "POST", "/v1/jobs", data=three_region_job(aggregation)
            )
            assert status == 201, body
            base = (await wait_collecting(observer, 0))["params_hash"]
            head = (await request(observer, "GET", "/v1/audit?limit=1"))[1]["head"]["seq"]
            honest = {name: honest_delta(i) for i, name in enumerate(HONEST)}
            uploads: dict[str, dict[str, torch.Tensor]] = {**honest, ATTACKER: attack}
            regions: dict[str, FakeRegion] = {}
            for name, tensors in uploads.items():
                regions[name] = running.region(name)
                manifest, stream = regions[name].delta(JOB, 0, base, seed=0, tensors=tensors)
                status, body = await regions[name].single_shot(JOB, 0, manifest, stream)
                assert (status, body["state"]) == (200, "accepted"), body
            await wait_collecting(observer, 1)
            update, _ = await regions["eu-west"].download_update(JOB, 0)
            return honest, update, await audit_after(observer, head)


def within_honest_range(
    honest: dict[str, dict[str, torch.Tensor]], update: dict[str, torch.Tensor]
) -> float:
    """How far -update (θ' = θ - Δ) strays outside the honest deltas' range, at most."""
    worst = 0.0
    for name in update:
        stack = torch.stack([deltas[name].reshape(-1) for deltas in honest.values()])
        applied = -update[name].reshape(-1)
        above = (applied - stack.max(dim=0).values).clamp(min=0)
        below = (stack.min(dim=0).values - applied).clamp(min=0)
        worst = max(worst, float(above.max()), float(below.max()))
    return worst


@pytest.mark.parametrize("scale", [1000.0, -50.0], ids=["scaled", "sign_flipped"])
async def test_median_keeps_one_bad_region_within_the_honest_range(
    scale: float, tmp_path: Path
) -> None:
    attack = {name: scale * t for name, t in honest_delta(0).items()}
    honest, update, _ = await run_round("{rule: median}", attack, tmp_path)
    # int8 blocks of 32 values of at most ~0.05: rounding is below 1e-3.
    assert within_honest_range(honest, update) < 1e-3
    mean_shift = max(
        float((torch.stack([d[name] for d in (*honest.values(), attack)]).mean(0)).abs().max())
        for name in update
    )
    assert mean_shift > 0.1  # what the token-weighted mean would have applied


async def test_norm_check_leaves_the_outlier_out_and_audits_why(tmp_path: Path) -> None:
    attack = {name: 1000.0 * t for name, t in honest_delta(7).items()}
    honest, update, entries = await run_round(
        "{rule: mean, norm_check: refuse, max_norm_ratio: 3.0}", attack, tmp_path
    )
    expected = {name: (honest["eu-west"][name] + honest["us-east"][name]) / 2 for name in update}
    for name in update:
        torch.testing.assert_close(-update[name], expected[name], atol=1e-3, rtol=0)
    (published,) = [e for e in entries if e["action"] == "round.publish"]
    (verdict,) = published["details"]["norm_checks"]
    assert (verdict["region"], verdict["action"]) == (ATTACKER, "refused")
    assert "median" in verdict["reason"]
