"""The convergence benchmark's overlap streaming rows: their rounds, settings and curve."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks import convergence
from benchmarks._federation_sim import CurvePoint, RunResult, RunSpec


@pytest.mark.parametrize(
    ("h", "fragments", "total", "expected"),
    [
        (24, 4, 288, 6),  # exact: H/F divides the run
        (25, 4, 300, 6),  # 6.25: the nearest divisor of 300
        (25, 3, 300, 10),  # 8.33: 10 is nearer than 6
        (3, 4, 6, 1),  # below one step: one
        (10, 4, 6, 2),  # 2.5: a tie between 2 and 3, the smaller
    ],
)
def test_streaming_round_steps_is_the_divisor_nearest_h_over_f(
    h: int, fragments: int, total: int, expected: int
) -> None:
    steps = convergence.streaming_round_steps(h, fragments, total)
    assert steps == expected
    assert total % steps == 0


def test_streaming_rows_see_the_same_tokens_and_say_their_period() -> None:
    settings = convergence.parse_args(["--fragments", "3"])
    configs = convergence.main_configs(settings)
    assert set(convergence.MAIN_CONFIGS) < set(configs)
    total = settings.rounds * settings.inner_steps
    same_label, same = configs["streaming_same_h"]
    short_label, short = configs["streaming_h_over_f"]
    for fields in (same, short, configs["streaming_h_over_f_no_delay"][1]):
        assert fields["overlap"] == "streaming"
        assert fields["fragments"] == 3
        base = RunSpec(
            "x", "sync", 1, 1, rounds=settings.rounds, inner_steps=settings.inner_steps, seed=0
        )
        spec = replace(base, **fields)
        assert spec.total_steps == total
    assert "inner_steps" not in same
    no_delay = configs["streaming_h_over_f_no_delay"][1]
    assert no_delay == {**short, "arrival_fraction": 0.0}
    assert same["arrival_fraction"] == short["arrival_fraction"] == 1.0
    assert short["inner_steps"] == 10
    assert short["rounds"] == total // 10
    assert f"synced every {3 * settings.inner_steps} steps" in same_label
    assert "about H/F" in short_label
    assert "synced every 30 steps" in short_label
    exact = convergence.main_configs(convergence.parse_args(["--inner-steps", "24"]))
    assert "about" not in exact["streaming_h_over_f"][0]


@pytest.mark.parametrize("fragments", ["1", "65"])
def test_fragments_outside_the_job_range_are_refused(fragments: str) -> None:
    with pytest.raises(SystemExit) as exc:
        convergence.parse_args(["--fragments", fragments])
    assert exc.value.code == 2


def _run(name: str, steps: list[int], losses: list[float]) -> RunResult:
    spec = RunSpec(name, "diloco", regions=1, workers=1, rounds=1, inner_steps=1, seed=0)
    curve = [CurvePoint(s, 10 * s, loss) for s, loss in zip(steps, losses, strict=True)]
    return RunResult(spec, curve=curve)


def test_curve_table_shows_another_grid_at_its_last_evaluation_before_the_step() -> None:
    runs = {
        "a": [_run("a", [0, 5, 10], [5.0, 4.0, 3.0]), _run("a", [0, 5, 10], [5.0, 4.2, 3.2])],
        "b": [_run("b", [0, 2, 4, 6, 8, 10], [5.0, 4.8, 4.6, 4.4, 4.2, 4.0])] * 2,
    }
    rows = convergence.curve_table(runs)
    assert [row["step"] for row in rows] == [0, 5, 10]
    assert rows[1]["a"] == pytest.approx(4.1)
    assert rows[1]["b"] == pytest.approx(4.6)
    assert rows[1]["evaluated_at"] == {"b": 4}
    assert "evaluated_at" not in rows[0]
    assert "evaluated_at" not in rows[2]
    assert rows[2]["b"] == pytest.approx(4.0)
