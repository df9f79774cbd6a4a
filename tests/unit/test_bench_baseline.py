"""The trustworthy-baseline benchmark's own logic: paired gaps, their confidence, the
choice of rate, and the settings it refuses (its smoke run is in
``tests/integration/test_bench_runs.py``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks import baseline
from benchmarks._confidence import paired_gap, t_975


def test_t_quantiles_are_never_optimistic_between_table_rows() -> None:
    assert t_975(1) == pytest.approx(12.706)
    assert t_975(2) == pytest.approx(4.303)
    assert t_975(11) == t_975(10)  # between rows: the smaller df's, a wider interval
    assert t_975(1000) == pytest.approx(1.980)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_975(0)


def test_a_gap_is_paired_by_seed_and_resolved_only_when_its_interval_excludes_zero() -> None:
    base = [2.00, 2.40, 2.20]  # seeds differ a lot from each other...
    other = [2.05, 2.46, 2.24]  # ...but every seed is worse by about 0.05
    gap = paired_gap(base, other)
    assert gap.mean == pytest.approx(0.05)
    differences = [0.05, 0.06, 0.04]
    sd = math.sqrt(sum((d - 0.05) ** 2 for d in differences) / 2)
    assert gap.half_width == pytest.approx(4.303 * sd / math.sqrt(3))
    assert gap.resolved is True
    assert gap.relative == pytest.approx((0.05 / 2.0 + 0.06 / 2.4 + 0.04 / 2.2) / 3)
    assert "95% CI +0.0252..+0.0748" in gap.describe()

    noisy = paired_gap(base, [2.10, 2.30, 2.25])  # better on one seed, worse on two
    assert noisy.low is not None
    assert noisy.high is not None
    assert noisy.low < 0 < noisy.high
    assert noisy.resolved is False
    single = paired_gap([2.0], [2.1])
    assert single.resolved is None
    assert single.low is None
    assert "CI" not in single.describe()


def test_paired_gaps_need_the_same_seeds_on_both_sides() -> None:
    with pytest.raises(ValueError, match="same seeds"):
        paired_gap([2.0, 2.1], [2.0])
    with pytest.raises(ValueError, match="same seeds"):
        paired_gap([], [])


def test_the_best_rate_is_the_lowest_mean_and_a_tie_takes_the_lower_rate() -> None:
    finals = {
        "sync@0.001": [2.3, 2.3],
        "sync@0.002": [2.1, 2.3],
        "sync@0.004": [2.2, 2.2],
        "diloco@0.001": [2.5, 2.5],
        "diloco@0.002": [2.4, 2.4],
        "diloco@0.004": [2.6, 2.6],
    }
    grid = (0.001, 0.002, 0.004)
    assert baseline.best_rate(finals, "sync", grid) == 0.002  # 2.2 ties 2.2: the lower rate
    assert baseline.best_rate(finals, "diloco", grid) == 0.002


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seeds", "1"], "at least 2 seeds"),
        (["--steps", "1000"], "H and H/F must divide the steps"),
        (["--steps", "1020"], "H and H/F must divide the steps"),  # 30 does, 100 not
        (["--h", "30", "--fragments", "4"], "F must divide H"),
        (["--steps", "0"], "must be >= 1"),
        (["--lr-grid", "0.003,-1"], "every value must be > 0"),
    ],
)
def test_settings_that_break_equal_tokens_or_pairing_are_refused(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "baseline.json"
    with pytest.raises(SystemExit) as exc:
        baseline.main([*argv, "--out", str(out)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_the_replicas_row_halves_the_batch_and_keeps_the_validation_windows() -> None:
    settings = baseline.parse(["--smoke"])
    options = dict(baseline._options(settings, lr=0.003, halve_batch=True))
    plain = dict(baseline._options(settings, lr=0.003))
    assert options["batch_size"] * 2 == plain["batch_size"]
    assert options["batch_size"] * options["val_batches"] == (
        plain["batch_size"] * plain["val_batches"]
    )
    jobs = baseline.row_jobs(settings, {"sync": 0.006, "diloco": 0.003})
    replicas = [job.spec for job in jobs if job.config == "replicas"]
    assert {spec.regions for spec in replicas} == {2 * settings.regions}
    assert {spec.seed for spec in replicas} == {2, 3}
    assert {dict(job.options)["lr"] for job in jobs if job.config == "sync"} == {0.006}
