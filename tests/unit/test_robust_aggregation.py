"""Robust aggregation: the norm check, coordinate-wise median and trimmed mean, streamed."""

import math

import pytest
import torch

from coordinator.aggregation.config import MAX_TOKENS_PER_STEP, AggregationConfig
from coordinator.aggregation.robust import (
    combine,
    coordinate_statistic,
    judge_norms,
    lockstep,
    region_norm,
)
from coordinator.aggregation.weighted import AggregationError, aggregate
from tests.support.aggregation import SPECS, assert_bit_identical, delta, pieces, source

REGIONS = ("aa", "bb", "cc", "dd", "ee")


def stacked(deltas: dict[str, dict[str, torch.Tensor]], name: str) -> torch.Tensor:
    return torch.stack([deltas[r][name].reshape(-1) for r in sorted(deltas)])


def reference(stack: torch.Tensor, rule: str, trim: float) -> torch.Tensor:
    """torch's own statistics, computed the obvious way on the whole stack."""
    if rule == "median":
        return torch.quantile(stack, 0.5, dim=0, interpolation="midpoint")
    cut = math.floor(trim * stack.shape[0])
    return stack.sort(dim=0).values[cut : stack.shape[0] - cut].mean(dim=0)


@pytest.mark.parametrize(
    ("rule", "trim", "regions", "chunks"),
    [
        ("median", 0.1, 1, (8,)),
        ("median", 0.1, 2, (8, 8)),
        ("median", 0.1, 3, (8, 5, 13)),
        ("median", 0.1, 4, (3, 8, 8, 40)),
        ("median", 0.1, 5, (7, 7, 7, 7, 7)),
        ("trimmed_mean", 0.0, 3, (8, 8, 8)),
        ("trimmed_mean", 0.2, 5, (8, 3, 11, 8, 1)),
        ("trimmed_mean", 0.25, 4, (8, 16, 4, 8)),
        ("trimmed_mean", 0.49, 5, (8, 8, 8, 8, 8)),
    ],
)
def test_streamed_statistic_equals_torch_reference(
    rule: str, trim: float, regions: int, chunks: tuple[int, ...]
) -> None:
    names = REGIONS[:regions]
    deltas = {r: delta(10 + i) for i, r in enumerate(names)}
    # Regions may cut their streams into chunks of different sizes.
    sources = {r: pieces(deltas[r], chunk=c) for r, c in zip(names, chunks, strict=True)}
    result = lockstep(SPECS, sources, lambda s: coordinate_statistic(s, rule, trim))  # type: ignore[arg-type]
    for name, shape in SPECS.items():
        expected = reference(stacked(deltas, name), rule, trim).reshape(shape)
        assert result[name].shape == shape
        torch.testing.assert_close(result[name], expected, rtol=1e-6, atol=1e-7)


def test_streamed_statistic_is_deterministic() -> None:
    deltas = {r: delta(i) for i, r in enumerate(REGIONS)}
    config = AggregationConfig(rule="trimmed_mean", trim_fraction=0.2)
    runs = [
        combine(SPECS, {r: (1.0, source(deltas[r], chunk=c)) for r in REGIONS}, config).delta
        for c in (4, 8)
    ]
    assert_bit_identical(runs[0], runs[1])


def test_median_stays_within_the_honest_range_with_one_scaled_or_flipped_region() -> None:
    honest = {r: delta(i) for i, r in enumerate(("aa", "bb", "cc"))}
    for bad in (
        {n: 1000.0 * t for n, t in delta(99).items()},
        {n: -50.0 * t for n, t in honest["aa"].items()},
    ):
        deltas = {**honest, "zz": bad}
        result = lockstep(
            SPECS,
            {r: pieces(d) for r, d in deltas.items()},
            lambda s: coordinate_statistic(s, "median", 0.0),
        )
        for name in SPECS:
            low = stacked(honest, name).min(dim=0).values
            high = stacked(honest, name).max(dim=0).values
            flat = result[name].reshape(-1)
            assert bool(((flat >= low) & (flat <= high)).all()), name


def test_lockstep_refuses_streams_that_are_not_aligned() -> None:
    a, b = delta(1), delta(2)
    reordered = pieces(b)[::-1]
    with pytest.raises(AggregationError, match="out of order"):
        lockstep(SPECS, {"aa": pieces(a), "bb": reordered}, lambda s: s[0])
    with pytest.raises(AggregationError, match=r"\['bb'\] ended before"):
        lockstep(SPECS, {"aa": pieces(a), "bb": pieces(b)[:-1]}, lambda s: s[0])
    bad = {**b, "b": torch.full((5,), float("nan"))}
    with pytest.raises(AggregationError, match="NaN or Inf"):
        lockstep(SPECS, {"aa": pieces(a), "bb": pieces(bad)}, lambda s: s[0])


@pytest.mark.parametrize(
    ("norms", "check", "expected"),
    [
        # (region norms, check, {region: (action, scale)}) for the regions not kept
        ({"aa": 1.0, "bb": 1.1, "cc": 100.0}, "off", {}),
        ({"aa": 1.0, "bb": 1.1, "cc": 100.0}, "clip", {"cc": ("clipped", 3.3 / 100.0)}),
        ({"aa": 1.0, "bb": 1.1, "cc": 100.0}, "refuse", {"cc": ("refused", 0.0)}),
        ({"aa": 1.0, "bb": 1.1, "cc": 3.3}, "refuse", {}),  # exactly at the bound: kept
        ({"aa": 1.0, "bb": 2.0, "cc": 2.0, "dd": 50.0}, "refuse", {"dd": ("refused", 0.0)}),
        ({"aa": 0.0, "bb": 0.0, "cc": 1.0}, "clip", {"cc": ("clipped", 0.0)}),
        ({"aa": 1.0, "bb": 100.0}, "refuse", {}),  # two regions: the median is their midpoint
    ],
)
def test_norm_verdicts(
    norms: dict[str, float], check: str, expected: dict[str, tuple[str, float]]
) -> None:
    verdicts = judge_norms(norms, check, 3.0)  # type: ignore[arg-type]
    assert [v.region for v in verdicts] == sorted(norms)
    flagged = {v.region: (v.action, v.scale) for v in verdicts if v.action != "kept"}
    assert flagged.keys() == expected.keys()
    for region, (action, scale) in expected.items():
        assert flagged[region][0] == action
        assert flagged[region][1] == pytest.approx(scale)


def test_refusal_names_the_region_and_its_reason() -> None:
    honest = {r: delta(i) for i, r in enumerate(("aa", "bb", "cc"))}
    deltas = {**honest, "zz": {n: 100.0 * t for n, t in delta(7).items()}}
    config = AggregationConfig(norm_check="refuse", max_norm_ratio=3.0)
    combined = combine(SPECS, {r: (1.0, source(d)) for r, d in deltas.items()}, config)
    (flagged,) = combined.flagged
    assert (flagged.region, flagged.action) == ("zz", "refused")
    assert "median" in flagged.reason
    assert "3 x" in flagged.reason
    expected = aggregate(SPECS, {r: (1.0, source(d)) for r, d in honest.items()})
    assert_bit_identical(combined.delta, expected)


def test_clipping_bounds_one_scaled_region() -> None:
    honest = {r: delta(i) for i, r in enumerate(("aa", "bb", "cc"))}
    deltas = {**honest, "zz": {n: 1000.0 * t for n, t in delta(7).items()}}
    sizes = {n: math.prod(s) for n, s in SPECS.items()}
    norms = {r: region_norm(r, pieces(d), sizes) for r, d in deltas.items()}
    config = AggregationConfig(norm_check="clip", max_norm_ratio=2.0)
    combined = combine(SPECS, {r: (1.0, source(d)) for r, d in deltas.items()}, config)
    (flagged,) = combined.flagged
    assert (flagged.region, flagged.action) == ("zz", "clipped")
    bound = 2.0 * flagged.median
    assert flagged.scale * norms["zz"] == pytest.approx(bound)
    # The clipped region moves the mean by at most bound / R: its clipped norm over R.
    without = aggregate(SPECS, {r: (1.0, source(d)) for r, d in honest.items()})
    moved = math.sqrt(
        sum(
            float((combined.delta[n] - 3.0 / 4.0 * without[n]).double().square().sum())
            for n in SPECS
        )
    )
    assert moved == pytest.approx(bound / 4.0, rel=1e-4)


def test_mean_without_norm_check_is_the_weighted_mean_bit_for_bit() -> None:
    deltas = {r: delta(i) for i, r in enumerate(REGIONS[:3])}
    weights = {"aa": 100.0, "bb": 300.0, "cc": 7.0}
    sources = {r: (weights[r], source(d)) for r, d in deltas.items()}
    combined = combine(SPECS, sources, AggregationConfig())
    assert_bit_identical(combined.delta, aggregate(SPECS, sources))
    assert combined.flagged == ()


def test_token_bound_defaults_to_a_per_step_bound() -> None:
    assert AggregationConfig().token_bound(50) == 50 * MAX_TOKENS_PER_STEP
    assert AggregationConfig(max_tokens_per_round=1000).token_bound(50) == 1000
    assert AggregationConfig().token_bound(1000) < 10**15
