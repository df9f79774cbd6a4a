"""The benchmarks' own logic: seed comparison, model layouts, argument refusals.

Their end-to-end smoke runs (child processes, the git revision) are in
``tests/integration/test_bench_runs.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks import convergence, round_overhead, training_throughput
from benchmarks._federation_sim import CurvePoint, RunResult, RunSpec

LN_256 = math.log(256)


def test_sweep_refuses_h_that_breaks_equal_tokens(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    with pytest.raises(SystemExit) as exc:
        convergence.main(["--smoke", "--sweep", "--sweep-h", "4", "--out", str(out)])
    assert exc.value.code == 2
    assert not out.exists()


def _result(name: str, seed: int, loss: float) -> RunResult:
    spec = RunSpec(name, "diloco", regions=2, workers=1, rounds=1, inner_steps=1, seed=seed)
    return RunResult(spec, curve=[CurvePoint(0, 0, LN_256), CurvePoint(1, 10, loss)])


def test_compare_pairs_seeds_and_reports_differences_inside_the_spread() -> None:
    runs = {
        "a": [_result("a", 0, 2.00), _result("a", 1, 2.10)],
        "b": [_result("b", 0, 2.02), _result("b", 1, 2.08)],
    }
    inside = convergence.compare(runs, "a", "b")
    assert inside["mean_difference"] == pytest.approx(0.0)
    assert inside["seed_spread"] == pytest.approx(0.10)
    assert inside["within_seed_spread"] is True

    runs["c"] = [_result("c", 0, 2.50), _result("c", 1, 2.52)]
    outside = convergence.compare(runs, "c", "a")
    assert outside["mean_relative_difference"] == pytest.approx((0.5 / 2.0 + 0.42 / 2.1) / 2)
    assert outside["within_seed_spread"] is False

    single = convergence.compare({"a": runs["a"][:1], "b": runs["b"][:1]}, "a", "b")
    assert single["within_seed_spread"] is None


def test_charlm_layout_reaches_the_requested_size() -> None:
    config = round_overhead.charlm_config(25_000_000)
    assert config["d_model"] == 512
    params = sum(math.prod(s) for s in round_overhead.charlm_shapes(config).values())
    smaller = round_overhead.charlm_shapes({**config, "n_layers": config["n_layers"] - 1})
    assert sum(math.prod(s) for s in smaller.values()) < 25_000_000 <= params


def test_round_overhead_refuses_bad_region_counts(tmp_path: Path) -> None:
    out = tmp_path / "round_overhead.json"
    with pytest.raises(SystemExit) as exc:
        round_overhead.main(["--regions", "2,0", "--out", str(out)])
    assert exc.value.code == 2
    assert not out.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["--parallelism", "ddp,zero3"],
        ["--precision", "fp16"],
        ["--peak-flops", "bf16=fast"],
        ["--peak-flops", "fp8=1e12"],
        ["--world-sizes", "2,0"],
        ["--repeats", "0"],
        ["--n-layers", "0"],
    ],
)
def test_training_throughput_refuses_bad_arguments(tmp_path: Path, argv: list[str]) -> None:
    out = tmp_path / "training_throughput.json"
    with pytest.raises(SystemExit) as exc:
        training_throughput.main([*argv, "--out", str(out)])
    assert exc.value.code == 2
    assert not out.exists()
