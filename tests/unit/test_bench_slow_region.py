"""The slow-region benchmark's arithmetic: curves, shares, and the equal-time comparison."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from benchmarks import slow_region
from benchmarks.slow_region import Point
from coordinator.state.audit import AuditEntry

T0 = 1_700_000_000.0


def _publish(round_: int, at_s: float, tokens: int, order: list[str]) -> AuditEntry:
    when = datetime.fromtimestamp(T0 + at_s, UTC).isoformat()
    details: dict[str, Any] = {"tokens": tokens, "order": order}
    return AuditEntry(round_, when, "c", "round.publish", "ok", "j", round_, None, details, "", "")


def test_the_loss_curve_follows_publications_and_their_tokens() -> None:
    entries = [
        _publish(1, 12.0, 300, ["eu-west", "us-east@0"]),
        _publish(0, 5.0, 100, ["eu-west"]),
    ]
    curve = slow_region.loss_curve(entries, {0: 4.0, 2: 3.0}, T0)
    assert curve == [
        Point(0, 0.0, 0, 4.0),
        Point(1, 5.0, 100, None),
        Point(2, 12.0, 400, 3.0),
    ]
    assert slow_region.loss_at_time(curve, 11.0) == 4.0  # θ_1 was not evaluated
    assert slow_region.loss_at_time(curve, 12.0) == 3.0
    assert slow_region.loss_at_tokens(curve, 150) == 3.0
    assert slow_region.loss_at_tokens(curve, 401) is None
    assert slow_region.rounds_in_theta(entries) == {"eu-west": 2, "us-east": 1}


def test_the_comparison_takes_the_fastest_time_and_the_fewest_tokens() -> None:
    fast = [Point(0, 0, 0, 4.0), Point(1, 10.0, 200, 3.0)]
    slow = [Point(0, 0, 0, 4.0), Point(1, 8.0, 100, 3.5), Point(2, 20.0, 300, 2.5)]
    modes: dict[str, dict[str, Any]] = {
        "a": {"curve": [p.__dict__ for p in fast]},
        "b": {"curve": [p.__dict__ for p in slow]},
        "failed": {"error": "x"},
    }
    result = slow_region.compare(modes)
    assert (result["at_s"], result["tokens"]) == (10.0, 200)
    assert result["loss"]["a"] == {"at_equal_time": 3.0, "at_equal_tokens": 3.0, "final": 3.0}
    assert result["loss"]["b"] == {"at_equal_time": 3.5, "at_equal_tokens": 2.5, "final": 2.5}
    assert slow_region.compare({}) == {}


def test_each_mode_asks_the_job_for_its_rule() -> None:
    assert slow_region.mode_fields("wait-all", None)["min_regions"] == 2
    merge = slow_region.mode_fields("merge", 6.5)
    assert merge["aggregation"] == {"late": "merge"}
    assert merge["deadline"] == {"initial_s": 6.5, "min_s": 6.5, "max_s": 6.5}
    assert slow_region.mode_fields("drop", 6.5)["aggregation"] == {"late": "drop"}
    with pytest.raises(ValueError, match="needs a deadline"):
        slow_region.mode_fields("drop", None)


@pytest.mark.parametrize(
    "argv",
    [
        ["--modes", "merge"],
        ["--modes", "fast"],
        ["--slowdown", "1"],
        ["--rounds", "0"],
    ],
)
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        slow_region.settings_from(argv)


def test_the_report_reads_as_a_table(tmp_path: Path) -> None:
    settings = slow_region.settings_from(["--deadline", "6", "--modes", "merge,drop"])
    assert settings.deadline_s == 6.0
    region = {
        "rounds_trained": 4,
        "rounds_in_theta": 3,
        "share_in_theta": 0.75,
        "train_s": 1.5,
        "round_s": 2.0,
    }
    run = {"wall_s": 30.0, "regions": {"eu-west": region, "us-east": region}}
    report = {
        "machine": {
            "cpu_model": "x",
            "usable_cpus": 2,
            "python": "3.11",
            "torch": "2.13.0",
            "torch_cpu_capability": "AVX2",
            "torch_threads": 2,
        },
        "settings": {
            "size": "s",
            "parameters": 279168,
            "rounds": 4,
            "inner_steps": 10,
            "slow": "us-east",
            "slowdown_asked": 2.0,
            "slowdown_measured": None,
            "deadline_s": 6.0,
            "note": "",
        },
        "modes": {"merge": run},
        "comparison": {},
    }
    text = slow_region.render(report)
    assert "| merge | 30.0 | us-east | 4 | 3 | 75% | 1.50 |" in text
