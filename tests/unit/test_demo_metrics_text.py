"""The demo's WAN totals read from counters that a coordinator restart sets back to zero."""

from __future__ import annotations

import pytest

from geofed_cli.demo.metrics_text import RestartSafeTotals


def test_totals_carry_what_the_counters_reached_across_a_restart() -> None:
    totals = RestartSafeTotals()
    assert totals.observe((10, 100)) == (10, 100)
    assert totals.observe((15, 130)) == (15, 130)
    # The coordinator restarted: its counters began again at zero.
    assert totals.observe((2, 0)) == (17, 130)
    assert totals.observe((5, 40)) == (20, 170)
    # Twice: each restart keeps what was reached before it.
    assert totals.observe((1, 50)) == (21, 220)


def test_a_reading_of_another_shape_is_refused() -> None:
    totals = RestartSafeTotals()
    totals.observe((1, 2, 3))
    with pytest.raises(ValueError, match="2 counters read, 3 before"):
        totals.observe((1, 2))
