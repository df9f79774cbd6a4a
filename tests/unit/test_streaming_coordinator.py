"""The coordinator's side of ``overlap: streaming``, without sockets.

Round r of a streaming job synchronizes fragment r mod F of the model
(:mod:`geofed.fragments`): the job's context says which tensors that is, deltas naming
anything else are refused, the deltas are checked, stored and summed over those tensors,
the outer step moves only them (other momentum buffers and residuals are kept), the
signed update names only them, and θ_{r+1} keeps every other tensor of θ_r bit for bit.
A restarted coordinator decoding the durable deltas computes the same round as the sum
folded while they arrived.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.aggregation.accumulator import RoundAccumulator
from coordinator.aggregation.config import AggregationConfig
from coordinator.aggregation.outer_optimizer import (
    OuterOptimizer,
    OuterOptimizerConfig,
    OuterOptimizerError,
)
from coordinator.aggregation.outer_round import (
    DeltaSource,
    PublishedRound,
    publication_step,
    publish_initial,
    publish_round,
)
from coordinator.aggregation.weighted import Feed
from coordinator.errors import ApiError
from coordinator.intake.delta_checks import DeltaExpectation, check_delta_manifest
from coordinator.intake.delta_stream import verify_and_store
from coordinator.jobs.context import JobContext, JobContextError, build_context
from coordinator.jobs.initial_build import initial_parameters
from coordinator.jobs.spec import parse_job_spec
from coordinator.runtime import Runtime, load_runtime
from coordinator.storage.working_state import WorkingState
from geofed.artifact_check import apply_verified_update, snapshot_params, verify_artifact
from geofed.codec import EncodedStream, decode, encode_stream
from geofed.codec_params import CodecParams
from geofed.deltas import pseudo_gradient
from geofed.fragments import fragment_plan
from geofed.manifest import ArtifactProvenance, SignedManifest, build_manifest, sign_manifest
from geofed.params import parameters_vector_hash
from geofed.pki import TrustBundle
from geofed.types import ArtifactKind
from tests.support.coordinator import Setup, job_yaml, write_setup
from tests.support.pki import Principal

INT8 = CodecParams(scheme="int8", block_size=32)
REGIONS = ("eu-west", "us-east")


@dataclass(frozen=True)
class World:
    setup: Setup
    runtime: Runtime
    ctx: JobContext


def _context(runtime: Runtime, extra: str, job: str = "tiny") -> JobContext:
    spec = parse_job_spec(job_yaml(job, extra=extra), "job.yaml")
    return build_context(spec, runtime, "eu-ckpt")


@pytest.fixture
def world(tmp_path: Path) -> World:
    setup = write_setup(tmp_path, broker_port=1)
    runtime = load_runtime(setup.config())
    # TinyTask (hidden 8): 0.weight (8, 8), 0.bias (8,), 2.weight (2, 8), 2.bias (2,).
    return World(setup, runtime, _context(runtime, "overlap: streaming\nfragments: 2\n"))


# -- which tensors a round carries ------------------------------------------------


def test_the_context_says_which_tensors_each_round_carries(world: World) -> None:
    ctx = world.ctx
    order = list(ctx.shapes)
    plan = fragment_plan(ctx.shapes, 2)
    first, second = ctx.round_shapes(0), ctx.round_shapes(1)
    assert tuple(first) == plan.names(0) == ("0.weight",)
    assert tuple(second) == plan.names(1) == ("0.bias", "2.weight", "2.bias")
    assert ctx.round_shapes(2) == first  # round r carries fragment r mod F
    assert ctx.round_shapes(7) == second
    for shapes in (first, second):
        assert [n for n in order if n in shapes] == list(shapes)  # θ's order
    assert [spec.name for spec in ctx.round_tensor_specs(1)] == list(second)
    assert ctx.round_fp32_bytes(0) + ctx.round_fp32_bytes(1) == ctx.fp32_bytes
    assert ctx.round_fp32_bytes(0) == 4 * 64
    # A job that does not stream carries the whole model every round.
    plain = _context(world.runtime, "overlap: delayed\n", job="plain")
    assert plain.layout.fragments is None
    assert plain.round_shapes(3) == plain.shapes
    assert plain.round_tensor_specs(3) == plain.tensor_specs()
    assert plain.round_scope(3) == "the job's model"


def test_a_streaming_model_with_fewer_tensors_than_fragments_fails_at_start(
    world: World,
) -> None:
    with pytest.raises(JobContextError, match="a model of 4 tensors cannot be split into 8"):
        _context(world.runtime, "overlap: streaming\nfragments: 8\n", job="too-many")


# -- a round's deltas ----------------------------------------------------------------


def _theta(world: World) -> dict[str, torch.Tensor]:
    return initial_parameters(world.ctx.task, world.ctx.spec.seed)


def _local(theta: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: t - 0.01 * torch.randn(t.shape, generator=gen) for name, t in theta.items()}


def _fragment_delta(
    ctx: JobContext, round_: int, theta: dict[str, torch.Tensor], seed: int
) -> EncodedStream:
    """What a region sends for round ``round_``: the pseudo-gradient of the round's tensors."""
    names = ctx.round_shapes(round_)
    local = _local(theta, seed)
    delta = pseudo_gradient(
        {n: theta[n] for n in names},
        {n: local[n] for n in names},
    )
    return encode_stream(delta, INT8, chunk_elements=32)


def _signed(
    world: World, region: str, round_: int, stream: EncodedStream, base_hash: str
) -> SignedManifest:
    principal: Principal = world.setup.regions[region]
    ctx = world.ctx
    manifest = build_manifest(
        kind=ArtifactKind.MODEL_DELTA,
        job=ctx.job,
        round=round_,
        producer=principal.identity,
        stream=stream,
        provenance=(
            ArtifactProvenance(
                region=region,
                jurisdiction=ctx.jurisdictions.get(region, "unknown"),
                datasets=tuple(ctx.spec.regions[region]),
            ),
        ),
        created_at=datetime.now(UTC),
        base_round=round_,
        base_hash=base_hash,
        tokens={"eu-west": 300, "us-east": 100}[region],
    )
    cred = principal.credential
    return sign_manifest(manifest, cred.private_key, cred.certificate)


def _expectation(world: World, region: str, round_: int, base_hash: str) -> DeltaExpectation:
    """As the upload path builds it."""
    return world.ctx.delta_expectation(world.runtime.config, round_, region, base_hash)


def _refusal(signed: SignedManifest, expect: DeltaExpectation) -> ApiError:
    with pytest.raises(ApiError) as caught:
        check_delta_manifest(signed, expect)
    return caught.value


def test_a_delta_naming_other_tensors_than_the_rounds_is_refused(world: World) -> None:
    ctx = world.ctx
    theta = _theta(world)
    base = parameters_vector_hash(theta)
    expect = _expectation(world, "eu-west", 1, base)
    # The whole model, as a non-streaming region would send it.
    whole = encode_stream(pseudo_gradient(theta, _local(theta, 1)), INT8, chunk_elements=32)
    refused = _refusal(_signed(world, "eu-west", 1, whole, base), expect)
    assert (refused.status, refused.code) == (400, "shape_mismatch")
    assert refused.message == (
        "delta tensors differ from the tensors round 1 synchronizes (fragment 1 of F=2, "
        "numbered from 0): "
        "missing [], unexpected ['0.weight']"
    )
    # The previous round's fragment.
    stale = _fragment_delta(ctx, 0, theta, 1)
    refused = _refusal(_signed(world, "eu-west", 1, stale, base), expect)
    assert refused.code == "shape_mismatch"
    assert "missing ['0.bias', '2.bias', '2.weight'], unexpected ['0.weight']" in refused.message
    # The round's own fragment passes.
    check_delta_manifest(
        _signed(world, "eu-west", 1, _fragment_delta(ctx, 1, theta, 1), base), expect
    )


# -- publishing a streaming round ----------------------------------------------------


def _upload(
    world: World, region: str, round_: int, theta: dict[str, torch.Tensor], base: str, seed: int
) -> tuple[DeltaSource, Feed]:
    """A region's delta through the upload path's checks, stored; and its decoding again,
    as the engine folds it."""
    ctx = world.ctx
    stream = _fragment_delta(ctx, round_, theta, seed)
    signed = _signed(world, region, round_, stream, base)
    check_delta_manifest(signed, _expectation(world, region, round_, base))
    spooled = world.runtime.config.state_dir / f"spooled-{region}-{round_}"
    spooled.write_bytes(stream.to_bytes())
    digest, _ = verify_and_store(
        spooled, signed, ctx.round_tensor_specs(round_), ctx.publishing.deltas
    )
    tokens = signed.manifest.tokens
    assert tokens is not None
    return DeltaSource(region, tokens, digest), ctx.stored_delta(round_, digest)


def _round(world: World, state: WorkingState, seed: int) -> tuple[PublishedRound, PublishedRound]:
    """Round ``state.version`` published from the sum folded on arrival, and again from the
    durable deltas (a restarted coordinator)."""
    ctx, round_ = world.ctx, state.version
    order = ["us-east", "eu-west"]  # the arrival order
    accumulator = RoundAccumulator((round_, 1.0), ctx.round_shapes(round_))
    sources = []
    for offset, region in enumerate(order):
        source, pieces = _upload(
            world, region, round_, state.params, state.params_hash, seed + offset
        )
        accumulator.fold(region, float(source.tokens), pieces)
        sources.append(source)
    folded_sum, why = accumulator.take(order, {s.region: float(s.tokens) for s in sources})
    assert folded_sum is not None, why
    now = datetime.now(UTC)
    running = publish_round(ctx.publishing, state, sources, now, order=order, folded_sum=folded_sum)
    durable = publish_round(ctx.publishing, state, sources, now, order=order)
    assert (running.summation, durable.summation) == (
        "folded on arrival",
        "decoded at publication",
    )
    return running, durable


def _same_state(a: WorkingState, b: WorkingState) -> None:
    assert a.params_hash == b.params_hash
    assert a.optimizer_state["steps"] == b.optimizer_state["steps"]
    for field in ("params", "residual"):
        left, right = getattr(a, field) or {}, getattr(b, field) or {}
        assert list(left) == list(right)
        assert all(torch.equal(left[n], right[n]) for n in left)
    left_buffers = a.optimizer_state["momentum_buffers"]
    right_buffers = b.optimizer_state["momentum_buffers"]
    assert list(left_buffers) == list(right_buffers)
    assert all(torch.equal(left_buffers[n], right_buffers[n]) for n in left_buffers)


def _downloaded(world: World, published: PublishedRound) -> Any:
    data = world.ctx.publishing.location.path_of(published.update.bundle_digest).read_bytes()
    bundle: TrustBundle = world.setup.bundle()
    return verify_artifact(
        data,
        bundle,
        kind=ArtifactKind.GLOBAL_UPDATE,
        job=world.ctx.job,
        round_=published.round,
        now=datetime.now(UTC),
    )


def test_a_streaming_round_publishes_its_fragment_and_restarts_to_the_same_bits(
    world: World,
) -> None:
    ctx = world.ctx
    theta0 = _theta(world)
    optimizer = OuterOptimizer(OuterOptimizerConfig(momentum=0.9, momentum_warmup_rounds=0))
    state0, _, _ = publish_initial(ctx.publishing, theta0, optimizer, datetime.now(UTC))
    fragment0, fragment1 = tuple(ctx.round_shapes(0)), tuple(ctx.round_shapes(1))

    running, durable = _round(world, state0, seed=1)

    # A restarted coordinator decodes the durable deltas: the same round, bit for bit.
    assert durable.update == running.update
    _same_state(running.state, durable.state)
    state1 = running.state
    for name in theta0:
        changed = not torch.equal(state1.params[name], theta0[name])
        assert changed == (name in fragment0), name
    assert state1.params_hash == parameters_vector_hash(state1.params)
    assert list(state1.optimizer_state["momentum_buffers"]) == list(fragment0)
    assert list(state1.residual or {}) == list(fragment0)
    assert state1.optimizer_state["steps"] == 1
    # The signed update names the fragment only; a region applying it to θ_0 gets θ_1.
    update = _downloaded(world, running)
    assert [t.name for t in update.manifest.tensors] == list(fragment0)
    assert update.manifest.parameters_hash == state1.params_hash
    assert running.fp32_bytes == ctx.round_fp32_bytes(0)
    params, found = apply_verified_update(theta0, 0, state0.params_hash, update)
    assert found == state1.params_hash
    assert all(torch.equal(params[n], state1.params[n]) for n in theta0)
    # The working state saved for θ_1 loads back as it was.
    _same_state(ctx.publishing.params_store.load(running.pointers), state1)

    running, durable = _round(world, state1, seed=5)

    assert durable.update == running.update
    _same_state(running.state, durable.state)
    state2 = running.state
    for name in fragment0:  # fragment 0 rests: its tensors, momentum and residual are kept
        assert state2.params[name] is state1.params[name]
        assert torch.equal(
            state2.optimizer_state["momentum_buffers"][name],
            state1.optimizer_state["momentum_buffers"][name],
        )
        assert torch.equal((state2.residual or {})[name], (state1.residual or {})[name])
    for name in fragment1:
        assert not torch.equal(state2.params[name], state1.params[name])
    assert list(state2.optimizer_state["momentum_buffers"]) == list(ctx.shapes)
    assert list(state2.residual or {}) == list(ctx.shapes)
    assert state2.optimizer_state["steps"] == 2
    update = _downloaded(world, running)
    assert [t.name for t in update.manifest.tensors] == list(fragment1)
    params, found = apply_verified_update(state1.params, 1, state1.params_hash, update)
    assert found == state2.params_hash
    # Snapshots stay the whole fp32 θ (snapshot_every: 2 takes θ_2's).
    assert running.snapshot is not None
    data = ctx.publishing.location.path_of(running.snapshot.bundle_digest).read_bytes()
    snapshot = verify_artifact(
        data,
        world.setup.bundle(),
        kind=ArtifactKind.GLOBAL_CHECKPOINT,
        job=ctx.job,
        round_=2,
        now=datetime.now(UTC),
    )
    assert snapshot_params(snapshot)[1] == state2.params_hash
    assert list(snapshot.tensors) == list(ctx.shapes)

    # Round 2 is fragment 0's again: it restarts from the same durable deltas too.
    running, durable = _round(world, state2, seed=9)
    assert durable.update == running.update
    _same_state(running.state, durable.state)
    assert [t.name for t in _downloaded(world, running).manifest.tensors] == list(fragment0)


def test_a_robust_rule_aggregates_only_the_rounds_tensors(world: World) -> None:
    ctx = world.ctx
    job = dataclasses.replace(
        ctx.publishing, aggregation=AggregationConfig(rule="median", norm_check="clip")
    )
    theta0 = _theta(world)
    state0, _, _ = publish_initial(job, theta0, OuterOptimizer(), datetime.now(UTC))
    sources = [_upload(world, region, 0, theta0, state0.params_hash, 3)[0] for region in REGIONS]
    published = publish_round(job, state0, sources, datetime.now(UTC))
    fragment0 = tuple(ctx.round_shapes(0))
    assert published.summation == "decoded at publication"
    assert [t.name for t in _downloaded(world, published).manifest.tensors] == list(fragment0)
    for name in theta0:
        assert torch.equal(published.state.params[name], theta0[name]) == (name not in fragment0)


# -- the pure outer step of a fragment ---------------------------------------------


def _params(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(10, 6, generator=gen),
        "layer.weight": torch.randn(6, 6, generator=gen),
        "layer.bias": torch.randn(6, generator=gen),
        "head": torch.randn(3, 6, generator=gen),
    }


def _grad(theta: dict[str, torch.Tensor], names: tuple[str, ...], seed: int) -> dict[str, Any]:
    local = _local(theta, seed)
    return pseudo_gradient({n: theta[n] for n in names}, {n: local[n] for n in names})


CONFIG = OuterOptimizerConfig(lr=0.7, momentum=0.9, momentum_warmup_rounds=0)
FIRST, SECOND = ("embed", "head"), ("layer.weight", "layer.bias")


def test_a_streaming_publication_step_changes_only_its_fragment() -> None:
    theta = _params(0)
    state = OuterOptimizer(CONFIG).state_dict()
    step1 = publication_step(theta, _grad(theta, FIRST, 1), state, None, INT8, names=FIRST)
    assert list(decode(step1.stream.frames())) == list(FIRST)
    assert list(step1.params) == list(theta)
    for name in SECOND:
        assert step1.params[name] is theta[name]
    assert list(step1.residual) == list(FIRST)
    assert list(step1.optimizer_state["momentum_buffers"]) == list(FIRST)

    grad2 = _grad(step1.params, SECOND, 2)
    step2 = publication_step(
        step1.params, grad2, step1.optimizer_state, step1.residual, INT8, names=SECOND
    )
    for name in FIRST:
        assert step2.params[name] is step1.params[name]
        assert step2.residual[name] is step1.residual[name]
        assert torch.equal(
            step2.optimizer_state["momentum_buffers"][name],
            step1.optimizer_state["momentum_buffers"][name],
        )
    assert list(step2.residual) == list(theta)  # θ's order, whatever the rounds'
    assert step2.optimizer_state["steps"] == 2
    # Fragment 1 is stepped from scratch (its first buffers), at the second step's momentum.
    for name in SECOND:
        assert torch.equal(step2.optimizer_state["momentum_buffers"][name], grad2[name])

    # Fragment 0 again: its momentum and residual carry on from round 0.
    grad3 = _grad(step2.params, FIRST, 3)
    step3 = publication_step(
        step2.params, grad3, step2.optimizer_state, step2.residual, INT8, names=FIRST
    )
    for name in FIRST:
        old = step1.optimizer_state["momentum_buffers"][name]
        assert torch.equal(
            step3.optimizer_state["momentum_buffers"][name], old.mul(0.9).add(grad3[name])
        )
    for name in SECOND:
        assert step3.params[name] is step2.params[name]


def test_a_step_over_every_tensor_gives_the_bits_of_the_plain_step() -> None:
    theta = _params(0)
    grad = _grad(theta, tuple(theta), 1)
    state = OuterOptimizer(CONFIG).state_dict()
    plain = publication_step(theta, grad, state, None, INT8)
    named = publication_step(theta, grad, state, None, INT8, names=tuple(theta))
    assert named.stream.to_bytes() == plain.stream.to_bytes()
    assert parameters_vector_hash(named.params) == parameters_vector_hash(plain.params)
    assert all(torch.equal(named.residual[n], plain.residual[n]) for n in theta)


def test_a_streaming_step_refuses_a_mean_of_other_tensors() -> None:
    theta = _params(0)
    state = OuterOptimizer(CONFIG).state_dict()
    with pytest.raises(OuterOptimizerError, match=r"unexpected \['embed', 'head'\]"):
        publication_step(theta, _grad(theta, FIRST, 1), state, None, INT8, names=SECOND)
    with pytest.raises(ValueError, match=r"unknown \['ghost'\]"):
        publication_step(theta, _grad(theta, FIRST, 1), state, None, INT8, names=("ghost",))
    # Without names the step is the whole model's, as before.
    with pytest.raises(OuterOptimizerError, match=r"missing \['layer.bias', 'layer.weight'\]"):
        publication_step(theta, _grad(theta, FIRST, 1), state, None, INT8)


def test_a_subset_step_keeps_other_buffers_and_its_state_round_trips() -> None:
    theta = _params(0)
    optimizer = OuterOptimizer(CONFIG)
    optimizer.step_subset({n: theta[n] for n in FIRST}, _grad(theta, FIRST, 1))
    optimizer.step_subset({n: theta[n] for n in SECOND}, _grad(theta, SECOND, 2))
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)
    restored = OuterOptimizer.from_state_dict(
        torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
    )
    assert restored.steps == optimizer.steps == 2
    grad = _grad(theta, FIRST, 3)
    ours = optimizer.step_subset({n: theta[n] for n in FIRST}, grad)
    theirs = restored.step_subset({n: theta[n] for n in FIRST}, grad)
    assert all(torch.equal(ours[n], theirs[n]) for n in FIRST)
    for name in theta:
        assert torch.equal(
            optimizer.state_dict()["momentum_buffers"][name],
            restored.state_dict()["momentum_buffers"][name],
        )


def test_a_subset_step_refuses_half_known_fragments_and_nothing() -> None:
    theta = _params(0)
    optimizer = OuterOptimizer(CONFIG)
    optimizer.step_subset({n: theta[n] for n in FIRST}, _grad(theta, FIRST, 1))
    before = optimizer.state_dict()
    mixed = ("embed", "layer.bias")
    with pytest.raises(OuterOptimizerError, match="momentum state's"):
        optimizer.step_subset({n: theta[n] for n in mixed}, _grad(theta, mixed, 2))
    with pytest.raises(OuterOptimizerError, match="at least one tensor"):
        optimizer.step_subset({}, {})
    # The full step keeps refusing a subset of the model it has buffers for.
    with pytest.raises(OuterOptimizerError, match="momentum state's"):
        optimizer.step(theta, _grad(theta, tuple(theta), 2))
    assert optimizer.state_dict()["steps"] == before["steps"] == 1
    assert list(optimizer.state_dict()["momentum_buffers"]) == list(FIRST)


def test_the_warm_up_ramps_over_a_fragments_own_steps() -> None:
    theta = _params(0)
    config = OuterOptimizerConfig(lr=0.5, momentum=0.8, momentum_warmup_rounds=4)
    optimizer = OuterOptimizer(config)
    optimizer.step_subset({n: theta[n] for n in FIRST}, _grad(theta, FIRST, 1))
    grad = _grad(theta, SECOND, 2)
    # The second fragment's first step, in round 1: its own first step, so μ = 0 (plain
    # SGD), not the μ = 0.2 of the job's second round.
    own = OuterOptimizer.from_state_dict(optimizer.state_dict())
    first = own.step_subset({n: theta[n] for n in SECOND}, grad, own_steps=0)
    by_round = OuterOptimizer.from_state_dict(optimizer.state_dict())
    counted = by_round.step_subset({n: theta[n] for n in SECOND}, grad)
    for name in SECOND:
        assert torch.equal(first[name], theta[name] - 0.5 * grad[name])
        assert torch.allclose(counted[name], theta[name] - 0.5 * 1.2 * grad[name])
    with pytest.raises(OuterOptimizerError, match="own_steps must be >= 0"):
        own.step_subset({n: theta[n] for n in SECOND}, grad, own_steps=-1)


def test_a_streaming_round_warms_up_over_the_fragments_own_steps(world: World) -> None:
    layout = world.ctx.layout
    assert layout.plan is not None
    fragments = layout.plan.count
    assert [layout.own_steps(r) for r in range(2 * fragments + 1)] == [
        r // fragments for r in range(2 * fragments + 1)
    ]
