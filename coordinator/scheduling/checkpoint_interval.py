"""How often a job takes a global snapshot: Young's first-order optimum, bounded.

With snapshot cost δ (seconds a snapshot takes out of the job) and mean time between
failures M of the job's regions, the interval that minimises expected lost plus
snapshot time is τ ≈ √(2·δ·M) (Young 1974; Daly 2006 refines it for δ close to M).
The job fails when any of its regions fails, so M combines the regions' rates:
1/M = Σ 1/Mᵢ. τ is turned into whole rounds and bounded by the job's settings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["SnapshotInterval", "combined_mtbf", "observed_mtbf", "snapshot_interval"]


@dataclass(frozen=True, slots=True)
class SnapshotInterval:
    """Snapshot every ``rounds`` rounds, and why."""

    rounds: int
    tau_s: float | None
    reason: str


def observed_mtbf(failures: int, exposure_s: float) -> float | None:
    """Mean time between failures seen over ``exposure_s`` seconds; None before any, and
    while no exposure is measured (a failure at once says nothing of a rate yet)."""
    if failures < 0 or exposure_s < 0:
        raise ValueError("failures and exposure must not be negative")
    return exposure_s / failures if failures and exposure_s > 0 else None


def combined_mtbf(mtbfs: Iterable[float | None]) -> float | None:
    """MTBF of a job that fails when any region fails; regions with none known add no rate."""
    rate = sum(1.0 / m for m in mtbfs if m is not None)
    return 1.0 / rate if rate > 0 else None


def snapshot_interval(
    snapshot_cost_s: float | None,
    mtbf_s: float | None,
    round_s: float,
    *,
    min_rounds: int = 1,
    max_rounds: int = 100,
) -> SnapshotInterval:
    """The snapshot interval in rounds for the measured cost, MTBF and round duration."""
    if not 1 <= min_rounds <= max_rounds:
        raise ValueError("need 1 <= min_rounds <= max_rounds")
    if round_s <= 0 or not math.isfinite(round_s):
        raise ValueError("round duration must be positive")
    if snapshot_cost_s is None or mtbf_s is None:
        missing = "snapshot cost" if snapshot_cost_s is None else "failures"
        return SnapshotInterval(
            max_rounds, None, f"no {missing} measured yet: the job's longest interval"
        )
    if snapshot_cost_s < 0 or mtbf_s <= 0:
        raise ValueError("snapshot cost must be >= 0 and MTBF > 0")
    tau = math.sqrt(2.0 * snapshot_cost_s * mtbf_s)
    ideal = tau / round_s
    rounds = min(max_rounds, max(min_rounds, round(ideal)))
    bound = ""
    if ideal < min_rounds - 0.5:
        bound = f", raised to the job's minimum {min_rounds}"
    elif ideal > max_rounds + 0.5:
        bound = f", lowered to the job's maximum {max_rounds}"
    return SnapshotInterval(
        rounds,
        tau,
        f"Young/Daly: sqrt(2 x {snapshot_cost_s:g} s x {mtbf_s:g} s) = {tau:.0f} s "
        f"= {ideal:.1f} rounds of {round_s:g} s{bound}",
    )
