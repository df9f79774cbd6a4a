"""A region's hardware risk and the snapshot it calls for (pure)."""

from __future__ import annotations

import pytest

from coordinator.publication.snapshot_policy import rearmed, risk_snapshot
from coordinator.scheduling.hardware_risk import (
    REARM_RISK,
    SNAPSHOT_RISK,
    Risk,
    job_risk,
    region_risk,
)
from geofed.control import HardwareSummary

NOW = 10_000.0


def node(**figures: object) -> HardwareSummary:
    return HardwareSummary.model_validate({"host": "gpu-node-1", "gpus": 8, **figures})


def test_a_healthy_or_unreported_region_has_no_risk() -> None:
    assert region_risk(node(max_temperature_c=70.0), 0, [], NOW) == Risk(0.0, "no sign of trouble")
    assert region_risk(None, None, [], NOW).score == 0.0
    # Errors the region had when first seen are not new.
    assert region_risk(node(ecc_uncorrected=3), 3, [], NOW).score == 0.0
    assert region_risk(node(ecc_uncorrected=3), None, [], NOW).score == 0.0


@pytest.mark.parametrize(
    ("figures", "first", "failures", "score", "reason"),
    [
        ({"ecc_uncorrected": 1}, 0, [], 0.8, "1 new uncorrectable ECC error(s) (0.80)"),
        ({"ecc_uncorrected": 5}, 2, [], 0.9, "3 new uncorrectable ECC error(s) (0.90)"),
        ({"slowed_gpus": 2}, None, [], 0.4, "2 GPU(s) slowed down (0.40)"),
        ({"max_temperature_c": 86.0}, None, [], 0.3, "a GPU at 86 °C (0.30)"),
        ({"max_temperature_c": 92.0}, None, [], 0.5, "a GPU at 92 °C (0.50)"),
        # Failures of the last hour only (one is older).
        ({}, None, [NOW - 4000, NOW - 600, NOW - 60], 0.4, "2 failure(s) in the last hour (0.40)"),
    ],
)
def test_each_sign_and_its_reason(
    figures: dict[str, object], first: int | None, failures: list[float], score: float, reason: str
) -> None:
    risk = region_risk(node(**figures), first, failures, NOW)
    assert risk.score == pytest.approx(score)
    assert risk.reason == reason


def test_signs_combine_as_independent_chances() -> None:
    risk = region_risk(node(slowed_gpus=2, max_temperature_c=91.0), None, [NOW - 10], NOW)
    assert risk.score == pytest.approx(1 - (1 - 0.4) * (1 - 0.5) * (1 - 0.2))
    assert risk.reason == (
        "2 GPU(s) slowed down (0.40); a GPU at 91 °C (0.50); 1 failure(s) in the last hour (0.20)"
    )
    assert 0.0 <= region_risk(node(ecc_uncorrected=99, slowed_gpus=8), 0, [NOW] * 9, NOW).score <= 1


def test_a_jobs_risk_is_its_riskiest_regions() -> None:
    risks = {"us-east": Risk(0.3, "a GPU at 86 °C (0.30)"), "eu-west": Risk(0.8, "ecc")}
    assert job_risk(risks) == Risk(0.8, "eu-west: ecc", "eu-west")
    assert job_risk({}).score == 0.0


def test_a_risk_snapshot_comes_again_only_at_a_further_rise_or_after_it_fell_back() -> None:
    high = Risk(0.82, "eu-west: 2 new uncorrectable ECC error(s) (0.85)", "eu-west")
    decision = risk_snapshot(high, acted_at=None)
    assert decision is not None
    assert decision.take
    assert decision.reason == (
        f"hardware risk 0.82 reached {SNAPSHOT_RISK}: "
        "eu-west: 2 new uncorrectable ECC error(s) (0.85)"
    )
    assert risk_snapshot(high, acted_at=0.82) is None  # taken already: the interval rules
    assert risk_snapshot(Risk(0.88, "a bit worse"), acted_at=0.82) is None
    assert risk_snapshot(Risk(0.95, "another region"), acted_at=0.82) is not None  # worse
    assert risk_snapshot(Risk(0.69, "below"), acted_at=None) is None
    # A dip that stays above REARM_RISK (a reading missing) does not re-arm it...
    assert rearmed(Risk(0.6, "dip"), 0.82) == 0.82
    # ...falling below it does: the next rise to 0.7 snapshots again.
    assert rearmed(Risk(REARM_RISK - 0.01, "calm"), 0.82) is None


def test_gpus_not_read_against_the_capacity_are_a_sign() -> None:
    risk = region_risk(node(gpus=6), None, [], NOW, gpus_offered=8)
    assert (risk.score, risk.reason) == (0.5, "2 of its 8 GPU(s) not read (0.50)")
    assert region_risk(node(gpus=8), None, [], NOW, gpus_offered=8).score == 0.0
    assert region_risk(node(gpus=0), None, [], NOW, gpus_offered=0).score == 0.0
