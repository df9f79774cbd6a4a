"""The simulator's corrections of the delayed fold: the mix a and the start of a round."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from benchmarks._federation_sim import (
    RunResult,
    RunSpec,
    SimulationError,
    _apply_late_update,
    delayed_start,
    simulate,
)
from coordinator.outer_optimizer import OuterOptimizer, OuterOptimizerConfig
from geofed.eager_start import OuterReplica
from geofed.examples.charlm import CharLMOptions, CharLMTask
from geofed.params import state_to_fp32

AVERAGE = OuterOptimizerConfig(kind="average")


@pytest.fixture(scope="module")
def task() -> CharLMTask:
    return CharLMTask(
        CharLMOptions(val_batches=1, d_model=16, n_heads=2, n_layers=1, seq_len=16, batch_size=4)
    )


def _losses(result: RunResult) -> list[float]:
    return [p.val_loss for p in result.curve]


def _delayed(**fields: object) -> RunSpec:
    base = RunSpec("x", "diloco", regions=2, workers=1, rounds=3, inner_steps=2, seed=0)
    return replace(base, **{"overlap": "delayed", **fields})  # type: ignore[arg-type]


def test_mix_one_reproduces_the_original_fold_bit_for_bit(task: CharLMTask) -> None:
    default = simulate(task, _delayed())
    explicit = simulate(task, _delayed(fold_mix=1.0, delayed_start="local"))
    assert _losses(explicit) == _losses(default)
    damped = simulate(task, _delayed(fold_mix=0.5))
    assert _losses(damped)[-1] != _losses(default)[-1]


def test_mix_zero_discards_the_stale_progress(task: CharLMTask) -> None:
    model = task.build_model(seed=0)
    theta = {name: t + 1.0 for name, t in state_to_fp32(model).items()}
    snapshot = {name: t - 0.5 for name, t in state_to_fp32(model).items()}
    before = state_to_fp32(model)
    _apply_late_update(model, theta, snapshot, 0.0)
    after = state_to_fp32(model)
    for name in theta:
        assert torch.equal(after[name], theta[name])
    model2 = task.build_model(seed=0)
    _apply_late_update(model2, theta, snapshot, 0.25)
    half = state_to_fp32(model2)
    for name in theta:
        expected = theta[name] + 0.25 * (before[name] - snapshot[name])
        assert torch.allclose(half[name], expected, atol=1e-6)


def test_mix_zero_with_late_arrival_sends_nothing_after_round_zero(task: CharLMTask) -> None:
    # Every step of rounds >= 1 is trained before θ arrives and then discarded, so each
    # delta is 0 and plain averaging leaves θ where round 0 put it.
    run = simulate(task, _delayed(fold_mix=0.0, arrival_fraction=1.0, outer=AVERAGE))
    losses = _losses(run)
    assert losses[1] != losses[0]
    assert losses[2] == losses[1] == losses[3]


@pytest.mark.parametrize("start", ["global", "eager"])
def test_early_arrival_makes_every_start_the_waiting_schedule(task: CharLMTask, start: str) -> None:
    none = simulate(task, _delayed(overlap="none"))
    run = simulate(task, _delayed(delayed_start=start, arrival_fraction=0.0))
    assert run.tokens == none.tokens
    assert _losses(run) == pytest.approx(_losses(none), abs=1e-4)


def test_eager_start_is_exact_for_one_region_under_plain_averaging(task: CharLMTask) -> None:
    # One region's own delta is the whole mean, so the eager estimate is θ_(r+1) itself
    # and the late fold changes nothing: the run is the waiting one.
    one: dict[str, object] = {"regions": 1, "outer": AVERAGE, "arrival_fraction": 1.0}
    none = simulate(task, _delayed(overlap="none", **one))
    eager = simulate(task, _delayed(delayed_start="eager", **one))
    stale = simulate(task, _delayed(delayed_start="global", **one))
    assert _losses(eager) == pytest.approx(_losses(none), abs=1e-4)
    assert _losses(stale)[-1] != pytest.approx(_losses(none)[-1], abs=1e-3)


def test_replica_recovers_the_mean_delta_and_the_momentum() -> None:
    config = OuterOptimizerConfig(lr=0.3, momentum=0.8, momentum_warmup_rounds=2)
    coordinator = OuterOptimizer(config)
    replica = OuterReplica(config)
    generator = torch.Generator().manual_seed(0)
    theta = {"w": torch.randn(5, generator=generator)}
    for _ in range(4):
        mean = {"w": torch.randn(5, generator=generator)}
        new = coordinator.step(theta, mean)
        # What the replica predicts for the true mean is the coordinator's step.
        assert torch.allclose(replica.estimate(theta, mean)["w"], new["w"], atol=1e-6)
        replica.observe(theta, new)
        assert replica.last_mean is not None
        assert torch.allclose(replica.last_mean["w"], mean["w"], atol=1e-5)
        theta = new


def test_eager_estimate_swaps_the_own_previous_delta_for_the_fresh_one() -> None:
    spec = _delayed(delayed_start="eager", regions=4, outer=AVERAGE)
    replica = OuterReplica(AVERAGE)
    base = {"w": torch.zeros(3)}
    replica.observe({"w": torch.full((3,), 2.0)}, base)  # ḡ_(r-1) = 2
    local = {"w": torch.full((3,), -1.0)}  # Δ_r = 1
    start = delayed_start(spec, base, local, {"w": torch.full((3,), 3.0)}, replica)
    # ĝ = 2 + (1 - 3) / 4 = 1.5; plain averaging: θ_r - ĝ.
    assert torch.equal(start["w"], torch.full((3,), -1.5))
    assert delayed_start(replace(spec, delayed_start="global"), base, local, None, replica) == base
    assert delayed_start(replace(spec, delayed_start="local"), base, local, None, replica) is local


@pytest.mark.parametrize("mix", [-0.1, 1.5])
def test_run_spec_refuses_a_mix_outside_zero_one(mix: float) -> None:
    with pytest.raises(SimulationError, match="fold_mix must be in"):
        RunSpec("x", "diloco", 2, 1, 1, 1, 0, overlap="delayed", fold_mix=mix)
