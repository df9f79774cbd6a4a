"""Compute utilization: the union of training intervals over the span they cover."""

from __future__ import annotations

import pytest

from regional_agent.handoff.utilization import compute_utilization, union_seconds


def test_serial_rounds_leave_the_gaps_out() -> None:
    # Three rounds of 8 s training, 2 s of communication between them.
    found = compute_utilization([(0, 8), (10, 18), (20, 28)])
    assert (found.busy_s, found.span_s, found.intervals) == (24, 28, 3)
    assert found.fraction == pytest.approx(24 / 28)


def test_overlapping_rounds_count_once() -> None:
    # With delayed overlap a round trains while the previous one is still in flight;
    # here the workers' intervals overlap and nest, in any order.
    found = compute_utilization([(5, 15), (0, 10), (6, 7), (20, 25)])
    assert found.busy_s == 20
    assert found.span_s == 25
    assert found.fraction == pytest.approx(0.8)


def test_touching_intervals_merge_and_a_busy_span_is_fully_utilized() -> None:
    assert union_seconds([(0, 1), (1, 2)]) == 2
    assert compute_utilization([(0, 1), (1, 2)]).fraction == 1.0


def test_no_span_has_no_fraction() -> None:
    assert compute_utilization([]).fraction is None
    assert compute_utilization([(3, 3)]).fraction is None


@pytest.mark.parametrize("bad", [(2.0, 1.0), (0.0, float("inf")), (float("nan"), 1.0)])
def test_bad_intervals_are_refused(bad: tuple[float, float]) -> None:
    with pytest.raises(ValueError, match="interval"):
        compute_utilization([(0, 1), bad])
