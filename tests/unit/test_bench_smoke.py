"""The benchmarks' own logic: seed comparison, model layouts, argument refusals.

Their end-to-end smoke runs (child processes, the git revision) are in
``tests/integration/test_bench_runs.py``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import convergence, round_overhead, training_throughput
from benchmarks._federation_sim import CurvePoint, RunResult, RunSpec, SimulationError

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


def _overlap_runs() -> dict[float | None, RunResult]:
    from benchmarks._federation_sim import simulate
    from geofed.examples.charlm import CharLMOptions, CharLMTask

    task = CharLMTask(
        CharLMOptions(val_batches=1, d_model=16, n_heads=2, n_layers=1, seq_len=16, batch_size=4)
    )
    base = RunSpec("x", "diloco", regions=2, workers=1, rounds=2, inner_steps=2, seed=0)
    runs: dict[float | None, RunResult] = {None: simulate(task, base)}
    for fraction in (0.0, 0.5, 1.0):
        spec = replace(base, overlap="delayed", arrival_fraction=fraction)
        runs[fraction] = simulate(task, spec)
    return runs


def test_delayed_overlap_trains_the_same_tokens_and_differs_only_by_the_delay() -> None:
    runs = _overlap_runs()
    none = runs[None]
    for fraction in (0.0, 0.5, 1.0):
        run = runs[fraction]
        assert run.tokens == none.tokens
        assert [p.step for p in run.curve] == [p.step for p in none.curve]
        # Round 0 starts from θ_0 in both modes: nothing is delayed yet.
        assert run.curve[1].val_loss == none.curve[1].val_loss
    # θ arriving before the first step is the waiting schedule, up to fp32 rounding of
    # y + (θ - S).
    for a, b in zip(runs[0.0].curve, none.curve, strict=True):
        assert a.val_loss == pytest.approx(b.val_loss, abs=1e-3)
    # Training on stale parameters for part or all of a phase changes the result.
    assert runs[1.0].final_val_loss != pytest.approx(none.final_val_loss, abs=1e-4)
    assert runs[0.5].final_val_loss != runs[1.0].final_val_loss


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_run_spec_refuses_an_arrival_outside_the_phase(fraction: float) -> None:
    with pytest.raises(SimulationError, match="arrival_fraction must be in"):
        RunSpec("x", "diloco", 2, 1, 1, 1, 0, overlap="delayed", arrival_fraction=fraction)


def test_outer_sweep_refuses_a_choice_seed_among_the_confirming_ones(tmp_path: Path) -> None:
    out = tmp_path / "outer.json"
    with pytest.raises(SystemExit) as exc:
        convergence.main(["--smoke", "--outer-sweep", "--confirm-seeds", "0,1", "--out", str(out)])
    assert exc.value.code == 2
    assert not out.exists()


def test_outer_sweep_grid_always_holds_plain_averaging() -> None:
    settings = convergence.parse_args(
        ["--outer-sweep", "--sweep-lr", "0.5", "--sweep-momentum", "0,0.9", "--sweep-warmup", "0,2"]
    )
    configs = convergence.sweep_outer_configs(settings)
    assert configs["lr1_m0_w0"].kind == "average"
    assert configs["lr0.5_m0.9_w2"].momentum_warmup_rounds == 2
    # A warm-up needs momentum to ramp, so momentum 0 runs once.
    assert set(configs) == {"lr0.5_m0_w0", "lr0.5_m0.9_w0", "lr0.5_m0.9_w2", "lr1_m0_w0"}


def test_overlap_sweep_folds_and_outer_grid() -> None:
    settings = convergence.parse_args(
        [
            "--overlap-sweep",
            "--sweep-mix",
            "0,1",
            "--sweep-start",
            "local,eager",
            "--sweep-lr",
            "0.3",
            "--sweep-momentum",
            "0,0.8",
        ]
    )
    folds = convergence.overlap_folds(settings)
    # Today's fold is always there; a = 1 from y_r is it, not a second entry.
    assert folds == {
        "local_mix1": ("local", 1.0),
        "local_mix0": ("local", 0.0),
        "eager_mix1": ("eager", 1.0),
    }
    assert convergence.overlap_folds_from("local_mix0.25") == ("local", 0.25)
    configs = convergence.overlap_outer_configs(settings)
    # lr 0.3 momentum 0.8 warm-up 4 is the defaults row; momentum 0 runs without warm-up.
    assert set(configs) == {"defaults", "lr0.3_m0_w0"}
    assert configs["lr0.3_m0_w0"].momentum_warmup_rounds == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["--overlap-sweep", "--sweep-start", "local,lazy"],
        ["--overlap-sweep", "--sweep-mix", "1.5"],
        ["--overlap-sweep", "--arrivals", "-0.5"],
        ["--overlap-sweep", "--outer-sweep"],
    ],
)
def test_overlap_sweep_refuses_bad_arguments(tmp_path: Path, argv: list[str]) -> None:
    out = tmp_path / "overlap.json"
    with pytest.raises(SystemExit) as exc:
        convergence.main([*argv, "--out", str(out)])
    assert exc.value.code == 2
    assert not out.exists()
