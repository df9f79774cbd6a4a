"""Adaptive round deadline: median + k x MAD of arrival times, clamped, growing on stragglers."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from coordinator.rounds.deadline import DeadlineConfig, DeadlineError, RoundTiming, next_deadline
from geofed.timeouts import Timeouts

CONFIG = DeadlineConfig(initial_s=900, min_s=120, max_s=7200, k=3, window_rounds=5)


def healthy_rounds(n: int, seed: int = 0, deadline_s: float = 900.0) -> list[RoundTiming]:
    rng = random.Random(seed)
    return [
        RoundTiming(deadline_s, tuple(rng.uniform(280, 320) for _ in range(4)), 0) for _ in range(n)
    ]


def test_too_little_history_uses_the_initial_deadline() -> None:
    value, reason = next_deadline([RoundTiming(900, (300.0,), 0)], CONFIG)
    assert value == 900
    assert reason == "only 1 arrival sample(s) (need 3); using the initial deadline 900 s"


def test_healthy_day_tightens_the_deadline() -> None:
    value, reason = next_deadline(healthy_rounds(5), CONFIG)
    # Arrivals 280-320 s: median ~300, slack >= 25% of it, far below the 900 s used so far.
    assert 370 <= value <= 420
    assert reason.startswith("median 30")
    assert "over 20 samples from the last 5 round(s)" in reason


def test_slow_day_with_stragglers_grows_the_deadline() -> None:
    # The WAN slowed down: arrivals took longer and half the regions missed the 400 s
    # deadline three rounds running, so their true durations are only known to exceed it.
    slow = [RoundTiming(400.0, (380.0 + i, 395.0 - i), 2) for i in range(3)]
    value, reason = next_deadline([*healthy_rounds(2, deadline_s=400.0), *slow], CONFIG)
    assert value == pytest.approx(600.0)
    assert "6 of 20 samples were stragglers (30% > 20%)" in reason
    assert reason.endswith("grown to 1.5 x the last deadline 400 s = 600.0 s")


def test_slow_day_without_stragglers_follows_the_arrivals() -> None:
    slow = [RoundTiming(1500.0, (600.0, 640.0, 610.0, 700.0), 0) for _ in range(5)]
    value, reason = next_deadline(healthy_rounds(5) + slow, CONFIG)
    assert value > 750  # median ~625 + slack
    assert "stragglers" not in reason


def test_one_outlier_region_barely_moves_it() -> None:
    base, _ = next_deadline(healthy_rounds(5), CONFIG)
    history = healthy_rounds(5)
    history[-1] = RoundTiming(900.0, (*history[-1].arrivals_s[:3], 3000.0), 0)
    with_outlier, _ = next_deadline(history, CONFIG)
    assert abs(with_outlier - base) < 0.05 * base


def test_only_the_window_counts() -> None:
    old_slow = [RoundTiming(7000.0, (5000.0, 5100.0, 5200.0), 0) for _ in range(20)]
    value, _ = next_deadline(old_slow + healthy_rounds(5), CONFIG)
    assert value < 450


@pytest.mark.parametrize(
    ("arrival", "expected", "needle"),
    [
        (10.0, 120.0, "raised to the minimum 120 s"),
        (9000.0, 7200.0, "capped at the maximum 7200 s"),
    ],
)
def test_clamped_to_bounds(arrival, expected, needle) -> None:
    history = [RoundTiming(9999.0, (arrival, arrival, arrival), 0)]
    value, reason = next_deadline(history, CONFIG)
    assert value == expected
    assert reason.endswith(needle)


def test_minimum_slack_when_all_regions_agree() -> None:
    value, reason = next_deadline([RoundTiming(900.0, (400.0, 400.0, 400.0), 0)], CONFIG)
    assert value == 500.0
    assert "minimum slack 0.25 x median = 100.0 s" in reason


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.builds(
            RoundTiming,
            deadline_s=st.floats(1, 1e5),
            arrivals_s=st.lists(st.floats(-10, 1e5), max_size=6).map(tuple),
            stragglers=st.integers(0, 4),
        ),
        max_size=12,
    )
)
def test_always_within_bounds_with_a_reason(history) -> None:
    value, reason = next_deadline(history, CONFIG)
    assert CONFIG.min_s <= value <= CONFIG.max_s
    assert reason


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"min_s": 600, "initial_s": 300}, "need min_s <= initial_s <= max_s"),
        ({"max_s": 100, "min_s": 60, "initial_s": 900}, "need min_s <= initial_s <= max_s"),
        ({"growth": 1.0}, "greater than 1"),
        ({"straggler_fraction": 1.5}, "less than or equal to 1"),
    ],
)
def test_config_validation(fields, needle) -> None:
    with pytest.raises(ValidationError, match=needle):
        DeadlineConfig.model_validate(fields)


def test_config_checked_against_the_timeouts() -> None:
    DeadlineConfig().check_against(Timeouts())
    with pytest.raises(
        DeadlineError,
        match=r"deadline min_s \(120\) must be greater than the coordinator's "
        r"timeouts\.upload_s \(300\): .* lower timeouts\.upload_s in the coordinator's config",
    ):
        CONFIG.check_against(Timeouts())


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"deadline_s": 0.0, "arrivals_s": ()}, "deadline_s must be a positive number"),
        ({"deadline_s": 10.0, "arrivals_s": (float("nan"),)}, "arrival times must be finite"),
        ({"deadline_s": 10.0, "arrivals_s": (), "stragglers": -1}, "stragglers must be >= 0"),
    ],
)
def test_round_timing_validation(kwargs, needle) -> None:
    with pytest.raises(DeadlineError, match=needle):
        RoundTiming(**kwargs)
