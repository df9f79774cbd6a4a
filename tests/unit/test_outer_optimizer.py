"""Outer optimizer: DiLoCo's Nesterov SGD and plain averaging over named fp32 tensors."""

import io
from types import MappingProxyType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from coordinator.aggregation.outer_optimizer import (
    OuterOptimizer,
    OuterOptimizerConfig,
    OuterOptimizerError,
)

# The DiLoCo paper's setting, without the default momentum warm-up: torch's SGD exactly.
DILOCO = OuterOptimizerConfig(lr=0.7, momentum=0.9, momentum_warmup_rounds=0)

# Shapes chosen to exercise torch's vectorized loop, its scalar tail and 0-d tensors.
SHAPES = {"w": (17, 5), "b": (3,), "big": (1031,), "scalar": ()}


def make(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) * scale for n, s in SHAPES.items()}


def reference_nesterov(params, grads_per_step, lr, momentum):
    """Direct float64 computation of the documented update rule."""
    theta = {n: p.double() for n, p in params.items()}
    buf: dict[str, torch.Tensor] = {}
    for grads in grads_per_step:
        for n, g in grads.items():
            g = g.double()
            buf[n] = g.clone() if n not in buf else momentum * buf[n] + g
            d = g + momentum * buf[n]
            theta[n] = theta[n] - lr * d
    return theta


def test_nesterov_matches_direct_reference_over_several_steps() -> None:
    params = make(0)
    steps = [make(10 + i, scale=0.1) for i in range(6)]
    opt = OuterOptimizer(DILOCO)
    current = params
    for grads in steps:
        current = opt.step(current, grads)
    expected = reference_nesterov(params, steps, lr=0.7, momentum=0.9)
    for name in SHAPES:
        # fp32 vs fp64: a few roundings per step, nothing more.
        torch.testing.assert_close(current[name].double(), expected[name], rtol=1e-5, atol=1e-6)
    assert opt.steps == 6


def run_torch_sgd(params, steps, **kwargs):
    tensors = {n: p.clone().requires_grad_(True) for n, p in params.items()}
    sgd = torch.optim.SGD(list(tensors.values()), **kwargs)
    for grads in steps:
        for n, t in tensors.items():
            t.grad = grads[n].clone()
        sgd.step()
    return {n: t.detach() for n, t in tensors.items()}


def assert_bit_identical(a, b) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.float32
        assert torch.equal(a[name].view(torch.int32), b[name].view(torch.int32)), name


def test_nesterov_is_bit_identical_to_torch_sgd() -> None:
    # Same ATen kernels in the same order, so the same bits (including the fused
    # multiply-add that add(alpha=) becomes in the vectorized kernels).
    params = make(1)
    steps = [make(20 + i, scale=0.05) for i in range(8)]
    opt = OuterOptimizer(DILOCO)
    current = params
    for grads in steps:
        current = opt.step(current, grads)
    expected = run_torch_sgd(
        params, steps, lr=0.7, momentum=0.9, nesterov=True, dampening=0.0, foreach=False
    )
    assert_bit_identical(current, expected)


@settings(max_examples=25, deadline=None)
@given(
    lr=st.floats(0.01, 2.0),
    momentum=st.floats(0.01, 0.99),
    seed=st.integers(0, 2**16),
    n_steps=st.integers(1, 4),
)
def test_any_nesterov_config_matches_torch_sgd(lr, momentum, seed, n_steps) -> None:
    params = make(seed)
    steps = [make(seed + 1 + i, scale=0.1) for i in range(n_steps)]
    opt = OuterOptimizer(OuterOptimizerConfig(lr=lr, momentum=momentum, momentum_warmup_rounds=0))
    current = params
    for grads in steps:
        current = opt.step(current, grads)
    expected = run_torch_sgd(params, steps, lr=lr, momentum=momentum, nesterov=True)
    assert_bit_identical(current, expected)


def test_average_returns_the_mean_of_local_parameters() -> None:
    params = make(2)
    locals_ = [make(30 + i) for i in range(3)]
    mean_local = {n: sum(loc[n] for loc in locals_) / 3 for n in SHAPES}
    pseudo = {n: params[n] - mean_local[n] for n in SHAPES}
    opt = OuterOptimizer(OuterOptimizerConfig(kind="average"))
    assert opt.config.lr == 1.0
    assert opt.config.momentum == 0.0
    first = opt.step(params, pseudo)
    for n in SHAPES:
        torch.testing.assert_close(first[n], mean_local[n], rtol=0, atol=1e-6)
    assert opt.state_dict()["momentum_buffers"] == {}  # no memory between rounds
    assert_bit_identical(first, run_torch_sgd(params, [pseudo], lr=1.0, momentum=0.0))


def test_step_mutates_neither_inputs_nor_saved_state() -> None:
    params, grads = make(3), make(4, scale=0.1)
    params_copy = {n: t.clone() for n, t in params.items()}
    grads_copy = {n: t.clone() for n, t in grads.items()}
    opt = OuterOptimizer()
    opt.step(params, grads)
    saved = opt.state_dict()
    saved_buffers = {n: t.clone() for n, t in saved["momentum_buffers"].items()}
    opt.step(params, grads)
    assert_bit_identical(params, params_copy)
    assert_bit_identical(grads, grads_copy)
    assert_bit_identical(saved["momentum_buffers"], saved_buffers)


def test_a_consumed_step_on_an_uncopied_state_gives_the_same_bits_and_writes_no_state() -> None:
    params, first, second = make(3), make(4, scale=0.1), make(5, scale=0.1)
    plain = OuterOptimizer(DILOCO)
    plain.step(params, first)
    saved = plain.state_dict()
    kept = {n: t.clone() for n, t in saved["momentum_buffers"].items()}
    expected = plain.step(params, second)

    shared = OuterOptimizer.from_state_dict(saved, copy=False)
    given = {n: t.clone() for n, t in second.items()}
    got = shared.step(params, given, consume=True)
    assert given == {}  # each tensor released once its target was made
    assert_bit_identical(got, expected)
    assert_bit_identical(
        shared.state_dict()["momentum_buffers"], plain.state_dict()["momentum_buffers"]
    )
    # The state it was loaded from, not copied, is as it was: the step made new buffers.
    assert_bit_identical(saved["momentum_buffers"], kept)
    with pytest.raises(OuterOptimizerError, match="must be a dict"):
        shared.step(params, MappingProxyType(dict(second)), consume=True)


def test_state_round_trips_bit_exactly_through_torch_save() -> None:
    params = make(5)
    steps = [make(40 + i, scale=0.1) for i in range(5)]
    uninterrupted = OuterOptimizer()
    current = params
    for grads in steps:
        current = uninterrupted.step(current, grads)

    first = OuterOptimizer()
    resumed = params
    for grads in steps[:3]:
        resumed = first.step(resumed, grads)
    blob = io.BytesIO()
    torch.save(first.state_dict(), blob)
    blob.seek(0)
    restored = OuterOptimizer.from_state_dict(torch.load(blob, weights_only=True))
    assert restored.steps == 3
    for grads in steps[3:]:
        resumed = restored.step(resumed, grads)
    assert_bit_identical(resumed, current)
    assert_bit_identical(
        restored.state_dict()["momentum_buffers"], uninterrupted.state_dict()["momentum_buffers"]
    )


def _bad_grads(kind: str) -> dict[str, torch.Tensor]:
    grads = make(6, scale=0.1)
    if kind == "missing":
        del grads["b"]
    elif kind == "extra":
        grads["extra"] = torch.zeros(2)
    elif kind == "shape":
        grads["b"] = torch.zeros(4)
    elif kind == "dtype":
        grads["b"] = grads["b"].double()
    elif kind == "nan":
        grads["big"][7] = float("nan")
    elif kind == "inf":
        grads["w"][0, 0] = float("inf")
    return grads


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("missing", r"missing \['b'\]"),
        ("extra", r"unexpected \['extra'\]"),
        ("shape", r"pseudo-gradient 'b' has shape \(4,\), parameter has \(3,\)"),
        ("dtype", r"pseudo-gradient 'b' must be a float32 tensor, not torch.float64"),
        ("nan", r"pseudo-gradient 'big' contains NaN or Inf"),
        ("inf", r"pseudo-gradient 'w' contains NaN or Inf"),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(kind, needle) -> None:
    params = make(7)
    opt = OuterOptimizer()
    opt.step(params, make(8, scale=0.1))
    before = opt.state_dict()
    before_buffers = {n: t.clone() for n, t in before["momentum_buffers"].items()}
    with pytest.raises(OuterOptimizerError, match=needle):
        opt.step(params, _bad_grads(kind))
    after = opt.state_dict()
    assert after["steps"] == 1
    assert_bit_identical(after["momentum_buffers"], before_buffers)


def test_names_must_match_the_momentum_state() -> None:
    opt = OuterOptimizer()
    opt.step({"a": torch.zeros(2)}, {"a": torch.ones(2)})
    with pytest.raises(OuterOptimizerError, match=r"momentum state's: missing \['a'\]"):
        opt.step({"b": torch.zeros(2)}, {"b": torch.ones(2)})


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (
            {"kind": "average", "lr": 0.7},
            "kind 'average' means lr 1.0, momentum 0 and no momentum warm-up; got lr 0.7",
        ),
        ({"momentum": 1.0}, "less than 1"),
        ({"lr": 0.0}, "greater than 0"),
        ({"lr": float("nan")}, "finite number"),
        ({"kind": "adam"}, "'nesterov' or 'average'"),
        ({"beta": 0.5}, "Extra inputs are not permitted"),
    ],
)
def test_config_validation(kwargs, needle) -> None:
    with pytest.raises(ValidationError, match=needle):
        OuterOptimizerConfig(**kwargs)


def test_config_defaults_are_the_swept_choice() -> None:
    # benchmarks/results/outer_sweep.md: chosen on the example task, beats plain averaging.
    cfg = OuterOptimizerConfig()
    assert (cfg.kind, cfg.lr, cfg.momentum, cfg.momentum_warmup_rounds) == (
        "nesterov",
        0.3,
        0.8,
        4,
    )


def test_load_refuses_state_saved_under_another_config() -> None:
    opt = OuterOptimizer()
    opt.step({"a": torch.zeros(2)}, {"a": torch.ones(2)})
    state = opt.state_dict()
    other = OuterOptimizer(OuterOptimizerConfig(lr=0.5))
    with pytest.raises(OuterOptimizerError, match=r"state was saved with .*'lr': 0.3"):
        other.load_state_dict(state)
    assert other.steps == 0


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda s: s.update(version=99), "version 99, expected 1"),
        (lambda s: s.update(steps=-1), "step count must be an integer >= 0"),
        (
            lambda s: s["momentum_buffers"].update(a=torch.zeros(2, dtype=torch.float64)),
            "not a float32",
        ),
        (lambda s: s["momentum_buffers"].update(a=torch.tensor([float("nan"), 0.0])), "NaN or Inf"),
        (lambda s: s.update(momentum_buffers=None), "no 'momentum_buffers'"),
    ],
)
def test_load_refuses_damaged_state(mutate, needle) -> None:
    opt = OuterOptimizer()
    opt.step({"a": torch.zeros(2)}, {"a": torch.ones(2)})
    state = opt.state_dict()
    state["momentum_buffers"] = dict(state["momentum_buffers"])
    mutate(state)
    fresh = OuterOptimizer()
    with pytest.raises(OuterOptimizerError, match=needle):
        fresh.load_state_dict(state)
    assert fresh.steps == 0
    assert fresh.state_dict()["momentum_buffers"] == {}


def test_momentum_warmup_ramps_linearly_then_holds() -> None:
    cfg = OuterOptimizerConfig(lr=0.5, momentum=0.8, momentum_warmup_rounds=4)
    assert [cfg.momentum_at(step) for step in range(7)] == pytest.approx(
        [0.0, 0.2, 0.4, 0.6, 0.8, 0.8, 0.8]
    )
    assert OuterOptimizerConfig(momentum=0.8, momentum_warmup_rounds=0).momentum_at(0) == 0.8
    # A warm-up of momentum 0 is no warm-up: plain SGD from the first step.
    assert OuterOptimizerConfig(momentum=0.0, momentum_warmup_rounds=3).momentum_at(5) == 0.0
    assert OuterOptimizerConfig(kind="average").momentum_warmup_rounds == 0


def test_momentum_warmup_matches_direct_reference() -> None:
    params = make(11)
    steps = [make(60 + i, scale=0.1) for i in range(6)]
    cfg = OuterOptimizerConfig(lr=0.6, momentum=0.9, momentum_warmup_rounds=3)
    opt = OuterOptimizer(cfg)
    current = params
    for grads in steps:
        current = opt.step(current, grads)
    theta = {n: p.double() for n, p in params.items()}
    buf: dict[str, torch.Tensor] = {}
    for step, grads in enumerate(steps):
        mu = 0.9 * min(1.0, step / 3)
        for n, g in grads.items():
            g = g.double()
            buf[n] = g.clone() if n not in buf else mu * buf[n] + g
            theta[n] = theta[n] - 0.6 * (g + mu * buf[n])
    for name in SHAPES:
        torch.testing.assert_close(current[name].double(), theta[name], rtol=1e-5, atol=1e-6)


def test_momentum_warmup_first_step_is_a_plain_lr_step() -> None:
    params, grads = make(12), make(13, scale=0.1)
    opt = OuterOptimizer(OuterOptimizerConfig(lr=0.6, momentum=0.9, momentum_warmup_rounds=2))
    first = opt.step(params, grads)
    assert_bit_identical(first, {n: params[n].add(grads[n], alpha=-0.6) for n in SHAPES})
    # Without the warm-up the first step is (1 + μ) times as long.
    plain_config = OuterOptimizerConfig(lr=0.6, momentum=0.9, momentum_warmup_rounds=0)
    plain = OuterOptimizer(plain_config).step(params, grads)
    assert not torch.equal(plain["w"], first["w"])


def test_state_resumed_during_momentum_warmup_is_bit_exact() -> None:
    cfg = OuterOptimizerConfig(lr=0.6, momentum=0.9, momentum_warmup_rounds=4)
    params = make(14)
    steps = [make(70 + i, scale=0.1) for i in range(6)]
    uninterrupted = OuterOptimizer(cfg)
    current = params
    for grads in steps:
        current = uninterrupted.step(current, grads)
    first = OuterOptimizer(cfg)
    resumed = params
    for grads in steps[:2]:
        resumed = first.step(resumed, grads)
    blob = io.BytesIO()
    torch.save(first.state_dict(), blob)
    blob.seek(0)
    restored = OuterOptimizer.from_state_dict(torch.load(blob, weights_only=True))
    assert restored.config.momentum_warmup_rounds == 4
    for grads in steps[2:]:
        resumed = restored.step(resumed, grads)
    assert_bit_identical(resumed, current)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"kind": "average", "momentum_warmup_rounds": 3}, "and momentum_warmup_rounds 3"),
        ({"momentum_warmup_rounds": -1}, "greater than or equal to 0"),
        ({"momentum_warmup_rounds": 1.5}, "valid integer"),
    ],
)
def test_momentum_warmup_validation(kwargs, needle) -> None:
    with pytest.raises(ValidationError, match=needle):
        OuterOptimizerConfig(**kwargs)


def test_load_refuses_state_saved_with_another_warmup() -> None:
    opt = OuterOptimizer(OuterOptimizerConfig(lr=0.6, momentum=0.9, momentum_warmup_rounds=2))
    opt.step({"a": torch.zeros(2)}, {"a": torch.ones(2)})
    other = OuterOptimizer(OuterOptimizerConfig(lr=0.6, momentum=0.9, momentum_warmup_rounds=0))
    with pytest.raises(OuterOptimizerError, match=r"'momentum_warmup_rounds': 2"):
        other.load_state_dict(opt.state_dict())


def test_state_saved_before_the_warmup_option_resumes_without_a_warmup() -> None:
    # States saved before momentum_warmup_rounds existed have no such key: they had no
    # warm-up, and must not take on the default's when a job resumes.
    opt = OuterOptimizer(DILOCO)
    params = make(15)
    current = opt.step(params, make(16, scale=0.1))
    state = opt.state_dict()
    state["config"] = {k: v for k, v in state["config"].items() if k != "momentum_warmup_rounds"}
    restored = OuterOptimizer.from_state_dict(state)
    assert restored.config == DILOCO
    grads = make(17, scale=0.1)
    assert_bit_identical(restored.step(current, grads), opt.step(current, grads))
