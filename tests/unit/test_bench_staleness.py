"""The delayed-fold benchmark's own logic: the runs it plans, the correction it reports as
best, its checks, and the settings it refuses (its smoke run is in
``tests/integration/test_bench_runs.py``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from benchmarks import baseline, staleness


def _settings(**fields: Any) -> staleness.Settings:
    base = staleness.Settings(
        seeds=2,
        steps=16,
        h=4,
        lags=(0.25, 0.5, 1.0),
        regions=2,
        lr=0.0015,
        jobs=1,
        smoke=True,
        out=Path("unused.json"),
        task_options=dict(baseline.SMOKE_OPTIONS),
    )
    return dataclasses.replace(base, **fields)


def test_every_correction_runs_at_every_lag_on_every_seed_with_its_own_fold() -> None:
    jobs = staleness.jobs(_settings())
    assert len(jobs) == 2 * (1 + 3 * len(staleness.CORRECTIONS))
    by_name = {(job.config, job.spec.seed): job.spec for job in jobs}
    assert by_name[("none", 1)].overlap == "none"
    blend = by_name[("blend@0.5", 0)]
    assert (blend.overlap, blend.arrival_fraction, blend.fold_blend) == ("delayed", 0.5, 0.5)
    assert by_name[("eager@1", 0)].delayed_start == "eager"
    assert by_name[("stale_lr@0.25", 1)].stale_scale == pytest.approx(1 / 1.25)
    plain = by_name[("plain@1", 0)]
    assert (plain.delayed_start, plain.fold_blend, plain.stale_weight) == ("local", None, False)
    # Equal tokens: every run has the same rounds of the same length.
    assert {(j.spec.rounds, j.spec.inner_steps) for j in jobs} == {(4, 4)}
    assert {dict(job.options)["lr"] for job in jobs} == {0.0015}


#: What describe_machine() reports (it asks the system, which a unit test does not).
MACHINE = {
    "cpu_model": "a test CPU",
    "usable_cpus": 2,
    "python": "3.11",
    "torch": "2.13.0",
    "torch_cpu_capability": "AVX2",
    "torch_threads": 1,
}


def _results(finals: dict[str, list[float]]) -> list[dict[str, Any]]:
    return [
        {"config": config, "seed": seed, "final_val_loss": loss}
        for config, losses in finals.items()
        for seed, loss in enumerate(losses)
    ]


def _finals(gaps: dict[str, float], lags: tuple[float, ...]) -> dict[str, list[float]]:
    """Seed losses around 2.0 and 2.2, each correction that much worse at every lag."""
    finals = {"none": [2.0, 2.2]}
    for correction, gap in gaps.items():
        for lag in lags:
            finals[staleness.config_name(correction, lag)] = [2.0 + gap, 2.2 + gap * 1.1]
    return finals


def test_the_best_correction_has_the_lowest_mean_gap_and_is_checked_against_the_target() -> None:
    settings = _settings(lags=(0.5, 1.0))
    finals = _finals({"plain": 0.1, "blend": 0.04, "eager": 0.01, "stale_lr": 0.2}, settings.lags)
    data, markdown = staleness.report(settings, _results(finals), 1.0, MACHINE)
    assert data["best"] == "eager"
    target, *versus = data["checks"]
    assert target["met"] is True  # +0.5 % at half a phase
    assert "within 1% of overlap none" in target["name"]
    assert [check["met"] for check in versus] == [True, True]  # better than plain, every seed
    assert data["gaps_vs_none"]["plain@0.5"]["relative"] == pytest.approx(0.05)
    assert "**eager start (overlap_start: eager)**" in markdown


def test_a_best_correction_above_the_target_is_reported_as_not_met() -> None:
    settings = _settings(lags=(0.5,))
    finals = _finals({"plain": 0.1, "blend": 0.1, "eager": 0.05, "stale_lr": 0.2}, settings.lags)
    data, _ = staleness.report(settings, _results(finals), 1.0, MACHINE)
    assert data["best"] == "eager"
    assert data["checks"][0]["met"] is False  # +2.5 % at half a phase


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seeds", "1"], "at least 2 seeds"),
        (["--steps", "18", "--h", "4"], "a multiple of --h"),
        (["--steps", "4", "--h", "4"], "at least two rounds"),
        (["--lags", "0.3", "--h", "4", "--steps", "16"], "whole steps"),
    ],
)
def test_settings_that_cannot_give_equal_tokens_or_exact_lags_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        staleness.parse(["--smoke", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("lags", "message"),
    [("0,0.5", "every value must be > 0"), ("0.5,1.5", "a lag is at most one inner phase")],
)
def test_a_lag_outside_zero_one_is_refused(
    lags: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        staleness.parse(["--lags", lags])
    assert message in capsys.readouterr().err


def test_a_count_of_zero_is_refused_not_taken_for_the_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        staleness.parse(["--smoke", "--jobs", "0"])
    assert "must be >= 1" in capsys.readouterr().err
