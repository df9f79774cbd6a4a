"""The simulator's overlap modes: corrections of the delayed fold (the mix a and the start of
a round) and streaming (one fragment of the model per round)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from benchmarks._federation_sim import (
    RunResult,
    RunSpec,
    SimCoordinator,
    SimulationError,
    _apply_late_update,
    delayed_start,
    simulate,
)
from coordinator.aggregation.outer_optimizer import OuterOptimizer, OuterOptimizerConfig
from geofed.codec import ErrorFeedback
from geofed.codec_params import CodecParams
from geofed.eager_start import OuterReplica
from geofed.examples.charlm import CharLMOptions, CharLMTask
from geofed.fragments import FragmentPlan, fragment_plan
from geofed.params import parameters_vector_hash, state_to_fp32
from regional_agent.rounds.delta import encode_delta

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


def test_blend_averages_the_region_with_the_theta_it_receives(task: CharLMTask) -> None:
    model = task.build_model(seed=0)
    before = state_to_fp32(model)
    theta = {name: t + 1.0 for name, t in before.items()}
    snapshot = {name: t - 0.5 for name, t in before.items()}  # Streaming's merge ignores S
    _apply_late_update(model, theta, snapshot, blend=0.25)
    after = state_to_fp32(model)
    for name in theta:
        assert torch.allclose(after[name], 0.25 * before[name] + 0.75 * theta[name], atol=1e-6)


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"fold_blend": 1.5}, "fold_blend must be in"), ({"fold_blend": 0.5, "fold_mix": 0.5}, "")],
)
def test_run_spec_refuses_a_blend_outside_zero_one_or_with_a_mix(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(SimulationError, match="fold_blend must be in"):
        RunSpec("x", "diloco", 2, 1, 1, 4, 0, overlap="delayed", **fields)  # type: ignore[arg-type]


def test_the_stale_weight_scales_by_the_lag_in_inner_phases() -> None:
    spec = RunSpec("x", "diloco", 2, 1, 1, 4, 0, overlap="delayed", arrival_fraction=0.5)
    assert spec.stale_scale == 1.0  # off by default
    assert replace(spec, stale_weight=True).stale_scale == pytest.approx(1 / 1.5)
    late = replace(spec, stale_weight=True, arrival_fraction=1.0)
    assert late.stale_scale == pytest.approx(0.5)


def test_the_stale_weight_leaves_round_zero_and_damps_the_later_rounds(task: CharLMTask) -> None:
    # Plain averaging: θ_(r+1) = θ_r - s * mean Δ. Round 0 folds no late θ (s = 1 there);
    # in round 1, half a phase late, the step is 2/3 of the plain one.
    two = {"outer": AVERAGE, "arrival_fraction": 0.5, "rounds": 2}
    plain = simulate(task, _delayed(**two))
    weighted = simulate(task, _delayed(stale_weight=True, **two))
    assert _losses(weighted)[:2] == _losses(plain)[:2]
    assert _losses(weighted)[-1] != _losses(plain)[-1]


# -- overlap: streaming --------------------------------------------------------------


def _streaming(fragments: int, **fields: object) -> RunSpec:
    return _delayed(overlap="streaming", fragments=fragments, **fields)


def _plan(task: CharLMTask, fragments: int) -> FragmentPlan:
    theta = state_to_fp32(task.build_model(seed=0))
    return fragment_plan({name: tuple(t.shape) for name, t in theta.items()}, fragments)


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    assert list(before) == list(after)
    return {name for name in before if not torch.equal(before[name], after[name])}


def test_a_streaming_round_changes_only_its_fragment_of_theta(task: CharLMTask) -> None:
    plan = _plan(task, 3)
    theta0 = state_to_fp32(task.build_model(seed=0))
    one = simulate(task, _streaming(3, rounds=1))
    assert _changed(theta0, one.params) == set(plan.names(0))
    two = simulate(task, _streaming(3, rounds=2))
    # Round 1 steps fragment 1 only: fragment 0 keeps round 0's bits, fragment 2 θ_0's.
    assert _changed(one.params, two.params) == set(plan.names(1))
    assert _changed(theta0, two.params) == set(plan.names(0)) | set(plan.names(1))


def test_streaming_deltas_and_updates_carry_only_the_fragment(task: CharLMTask) -> None:
    plan = _plan(task, 2)
    theta0 = state_to_fp32(task.build_model(seed=0))
    spec = _streaming(2, rounds=3, regions=2)
    run = simulate(task, spec)
    sizes = [4 * sum(theta0[name].numel() for name in plan.names(r)) for r in range(3)]
    assert run.fp32_bytes_up == spec.regions * sum(sizes)
    assert run.fp32_bytes_down == spec.regions * sum(sizes)
    assert sum(sizes) < 3 * 4 * sum(t.numel() for t in theta0.values())


def test_one_fragment_streaming_is_delayed_bit_for_bit(task: CharLMTask) -> None:
    for fields in ({}, {"arrival_fraction": 0.5, "fold_mix": 0.5, "scheme": "int8"}):
        delayed = simulate(task, _delayed(**fields))
        streaming = simulate(task, _streaming(1, **fields))
        assert _losses(streaming) == _losses(delayed)
        assert (streaming.bytes_up, streaming.bytes_down) == (delayed.bytes_up, delayed.bytes_down)
        assert parameters_vector_hash(streaming.params) == parameters_vector_hash(delayed.params)
    # More fragments is another run.
    assert _losses(simulate(task, _streaming(2)))[-1] != _losses(simulate(task, _delayed()))[-1]


def test_tensors_outside_the_fragment_train_on_locally(task: CharLMTask) -> None:
    # One region under plain averaging with θ arriving before the first step: each fold
    # puts the fragment back where the region had it, so the region trains exactly as
    # if alone, and the last round's fragment of θ is its model after every step. A fold
    # that reset the other tensors to θ (stale by up to F - 1 rounds) would not be.
    one: dict[str, object] = {"regions": 1, "outer": AVERAGE, "arrival_fraction": 0.0}
    rounds = 4
    streaming = simulate(task, _streaming(2, rounds=rounds, **one))
    alone = simulate(task, _delayed(overlap="none", method="sync", rounds=rounds, **one))
    plan = _plan(task, 2)
    for name in plan.names(rounds - 1):
        assert torch.allclose(streaming.params[name], alone.params[name], atol=1e-5), name
    stale = set(plan.names(rounds - 2))
    assert any(not torch.allclose(streaming.params[n], alone.params[n]) for n in stale)


def test_the_fold_replaces_only_the_snapshot_tensors(task: CharLMTask) -> None:
    model = task.build_model(seed=0)
    local = state_to_fp32(model)
    names = list(local)
    theta = {name: t + 1.0 for name, t in local.items()}
    snapshot = {names[0]: local[names[0]] - 0.5}
    _apply_late_update(model, theta, snapshot)
    after = state_to_fp32(model)
    assert torch.equal(after[names[0]], local[names[0]] + (theta[names[0]] - snapshot[names[0]]))
    for name in names[1:]:
        assert torch.equal(after[name], local[name])


def test_a_fragment_round_keeps_the_other_buffers_and_residuals() -> None:
    generator = torch.Generator().manual_seed(0)
    theta = {"a": torch.randn(300, generator=generator), "b": torch.randn(200, generator=generator)}
    codec = CodecParams(scheme="int8")
    coordinator = SimCoordinator(theta, OuterOptimizerConfig(momentum_warmup_rounds=0), codec)

    def round_(names: tuple[str, ...]) -> None:
        base = {name: coordinator.params[name] for name in names}
        local = {name: t - torch.randn(t.shape, generator=generator) for name, t in base.items()}
        coordinator.close_round(
            {"r": (1, encode_delta(base, local, ErrorFeedback(), codec))}, names
        )

    round_(("a",))
    state = coordinator._optimizer_state
    assert set(state["momentum_buffers"]) == {"a"}
    assert state["steps"] == 1
    assert coordinator._residual is not None
    assert set(coordinator._residual) == {"a"}
    assert torch.equal(coordinator.params["b"], theta["b"])
    buffer_a, residual_a, theta_a = (
        state["momentum_buffers"]["a"],
        coordinator._residual["a"],
        coordinator.params["a"],
    )
    round_(("b",))
    state = coordinator._optimizer_state
    assert set(state["momentum_buffers"]) == {"a", "b"}
    assert state["steps"] == 2
    assert torch.equal(state["momentum_buffers"]["a"], buffer_a)
    assert torch.equal(coordinator._residual["a"], residual_a)
    assert torch.equal(coordinator.params["a"], theta_a)
    assert not torch.equal(coordinator.params["b"], theta["b"])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"overlap": "streaming"}, "fragments is set exactly with overlap 'streaming'"),
        ({"overlap": "delayed", "fragments": 2}, "fragments is set exactly"),
        ({"overlap": "streaming", "fragments": 0}, "fragments must be >= 1"),
        (
            {"overlap": "streaming", "fragments": 2, "delayed_start": "eager"},
            "not available with overlap 'streaming'",
        ),
    ],
)
def test_run_spec_refuses_bad_streaming_settings(fields: dict[str, object], message: str) -> None:
    with pytest.raises(SimulationError, match=message):
        RunSpec("x", "diloco", 2, 1, 1, 1, 0, **fields)  # type: ignore[arg-type]


def test_more_fragments_than_tensors_is_refused(task: CharLMTask) -> None:
    tensors = len(state_to_fp32(task.build_model(seed=0)))
    with pytest.raises(SimulationError, match="cannot be split into"):
        simulate(task, _streaming(tensors + 1, rounds=1))
