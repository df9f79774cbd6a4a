"""A job's cost estimate and its budget (pure), checked against hand-computed figures."""

from __future__ import annotations

import pytest

from coordinator.costs.estimate import budget_json, estimate_job_cost, outlook_json
from coordinator.costs.prices import PriceTable
from coordinator.jobs.spec import JobSpec, JobSpecError, parse_job_spec
from tests.support.coordinator import job_yaml

PRICES = PriceTable.model_validate(
    {
        "currency": "EUR",
        "regions": {
            "eu-west": {"gpu_hour": {"H100": {"on_demand": 4.0}}},
            "us-east": {"gpu_hour": {"default": {"on_demand": 2.0}}},
        },
    }
)
NEEDS = "needs: {gpus: 2}\nregion_needs:\n  eu-west: {gpus: 4, gpu_kind: H100}\n"


def spec(extra: str = NEEDS, rounds: int = 10, deadline: float = 60) -> JobSpec:
    return parse_job_spec(job_yaml(rounds=rounds, deadline=deadline, extra=extra), "job.yaml")


def test_before_a_round_the_estimate_is_the_gpu_time_of_all_rounds_at_the_deadline() -> None:
    estimate = estimate_job_cost(spec(), PRICES)
    # 10 rounds x 60 s = 1/6 h: eu-west 4 x 4.0, us-east 2 x 2.0 an hour.
    assert estimate.amount == pytest.approx((4 * 4.0 + 2 * 2.0) / 6)
    assert estimate.reason == (
        "10 rounds x 60 s (the initial round deadline) of 4 GPU(s) in eu-west at 4/h, "
        "2 GPU(s) in us-east at 2/h; WAN and storage not included"
    )
    measured = estimate_job_cost(spec(), PRICES, round_s=18.0)
    assert measured.amount == pytest.approx((4 * 4.0 + 2 * 2.0) * 10 * 18 / 3600)
    assert "(the measured mean round)" in measured.reason


def test_what_cannot_be_priced_gives_no_estimate_and_says_why() -> None:
    assert estimate_job_cost(spec(), None).reason == (
        "no price table (prices: in the coordinator's config)"
    )
    unpriced = estimate_job_cost(spec(NEEDS.replace("H100", "A100")), PRICES)
    assert (unpriced.amount, unpriced.reason) == (None, "no GPU-hour price for eu-west (A100)")
    assert estimate_job_cost(spec(""), PRICES).amount is None
    assert estimate_job_cost(spec("needs: {cpu_slots: 1}\n"), PRICES).reason == (
        "the job states no GPUs: no GPU time to estimate"
    )


def test_the_budget_compares_with_the_projection_once_there_is_one() -> None:
    estimate = estimate_job_cost(spec(), PRICES)
    assert budget_json(None, estimate) is None
    assert budget_json(5.0, estimate) == {
        "amount": 5.0,
        "expected": pytest.approx(20 / 6),
        "within": True,
        "basis": estimate.reason,
    }
    over = budget_json(5.0, estimate, projected=7.5)
    assert over == {
        "amount": 5.0,
        "expected": 7.5,
        "within": False,
        "basis": "the projection of its cost so far",
    }
    unknown = budget_json(5.0, estimate_job_cost(spec(), None))
    assert unknown is not None
    assert (unknown["expected"], unknown["within"]) == (None, None)


def test_a_budget_is_stated_in_the_spec_and_left_out_of_its_json_when_not() -> None:
    stated = spec(NEEDS + "budget: 250\n")
    assert stated.budget == 250
    assert stated.to_json()["budget"] == 250
    assert "budget" not in spec().to_json(), "specs before it hash as they did"
    assert outlook_json(stated, PRICES)["budget"]["amount"] == 250
    assert outlook_json(stated, PRICES)["currency"] == "EUR"
    with pytest.raises(JobSpecError) as caught:
        spec(NEEDS + "budget: 0\n")
    assert caught.value.problems == ("job.yaml:11: budget: Input should be greater than 0 (got 0)",)
