"""What a job will cost, before it has run and while it runs, against its budget (pure).

Before a round is measured the estimate is the GPU time of all its rounds: in each of its
regions the GPUs its needs state, at the region's price for their kind, for ``rounds``
times its initial round deadline (rounds usually end sooner, so this errs high), or times
the measured mean round duration once there is one. WAN and storage depend on the
model's size and the codec, measured only once rounds are published: from then on the
job's status compares its budget with the projection of what it cost so far
(:func:`coordinator.costs.report.cost_json`), which includes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coordinator.costs.prices import PriceTable
from coordinator.jobs.spec import JobSpec

__all__ = ["CostEstimate", "budget_json", "estimate_job_cost", "outlook_json"]


@dataclass(frozen=True, slots=True)
class CostEstimate:
    """An estimated total (None: it cannot be made), and how it was made or why not."""

    amount: float | None
    reason: str


def estimate_job_cost(
    spec: JobSpec, prices: PriceTable | None, round_s: float | None = None
) -> CostEstimate:
    """The GPU cost of all of ``spec``'s rounds (``round_s``: the measured mean round
    duration; None: the initial round deadline stands in)."""
    if prices is None:
        return CostEstimate(None, "no price table (prices: in the coordinator's config)")
    if round_s is not None and round_s > 0:
        duration, how = round_s, "the measured mean round"
    else:
        duration, how = spec.deadline.initial_s, "the initial round deadline"
    hours = spec.rounds * duration / 3600
    total, unpriced, parts = 0.0, [], []
    for region in spec.region_names:
        need = spec.need_in(region)
        if need is None or not need.gpus:
            continue
        price = prices.gpu_hour(region, need.gpu_kind)
        if price is None:
            unpriced.append(f"{region} ({need.gpu_kind or 'any kind'})")
            continue
        total += need.gpus * hours * price
        parts.append(f"{need.gpus} GPU(s) in {region} at {price:g}/h")
    if unpriced:
        return CostEstimate(None, f"no GPU-hour price for {', '.join(unpriced)}")
    if not parts:  # what it costs is WAN and storage, known once rounds are published
        return CostEstimate(None, "the job states no GPUs: no GPU time to estimate")
    return CostEstimate(
        total,
        f"{spec.rounds} rounds x {duration:g} s ({how}) of {', '.join(parts)}; "
        "WAN and storage not included",
    )


def budget_json(
    budget: float | None,
    estimate: CostEstimate,
    projected: float | None = None,
    *,
    ended: bool = False,
) -> dict[str, Any] | None:
    """The ``budget`` object of a job's status and queue row (None: it states none):
    ``projected`` (the projection of what it cost so far, or, ``ended``, what it cost;
    None before a round was published) wins over the estimate when there is one."""
    if budget is None:
        return None
    expected = projected if projected is not None else estimate.amount
    if projected is None:
        basis = estimate.reason
    else:
        basis = "what it cost" if ended else "the projection of its cost so far"
    return {
        "amount": budget,
        "expected": expected,
        "within": None if expected is None else expected <= budget,
        "basis": basis,
    }


def outlook_json(
    spec: JobSpec,
    prices: PriceTable | None,
    round_s: float | None = None,
    projected: float | None = None,
    *,
    ended: bool = False,
) -> dict[str, Any]:
    """The ``cost_estimate`` object of the submission's answer, the queue and the job's
    status: ``{"currency", "amount", "reason", "budget"}`` (:func:`budget_json`)."""
    estimate = estimate_job_cost(spec, prices, round_s)
    return {
        "currency": None if prices is None else prices.currency,
        "amount": estimate.amount,
        "reason": estimate.reason,
        "budget": budget_json(spec.budget, estimate, projected, ended=ended),
    }
