"""The publication math end to end, without sockets.

Two fake regions encode deltas from θ_r; the coordinator aggregates them from its blob
store, takes the outer step, encodes the update with error feedback, signs and stores
it. What a region reconstructs from the stored update (θ_r + decode(update)) must be the
coordinator's θ_{r+1} bit for bit, and recomputing the round after a "crash" must give
the same bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.aggregation.outer_optimizer import OuterOptimizer, OuterOptimizerConfig
from coordinator.aggregation.outer_round import (
    PUBLICATION_PHASES,
    DeltaSource,
    JobPublishing,
    mean_delta,
    publication_step,
    publish_initial,
    publish_round,
)
from coordinator.storage.checkpoints import EntryKind
from coordinator.storage.working_state import WorkingState
from geofed.artifact_bundle import split_bundle
from geofed.blobstore import BlobStore, FsBlobStore
from geofed.codec import decode, encode_stream
from geofed.codec_params import CodecParams
from geofed.deltas import apply_update, feedback_residual, pseudo_gradient, update_to_publish
from geofed.manifest import ArtifactProvenance, SignedManifest
from geofed.params import parameters_vector_hash
from geofed.pki import TrustBundle
from geofed.types import ArtifactKind
from tests.support.pki import make_federation
from tests.support.publishing import job_publishing

NOW = datetime.now(UTC)


@pytest.fixture(autouse=True, scope="module")
def _fresh_now() -> None:
    """Take NOW when the module runs, not when it is imported: the certificates are issued
    then, and a long suite may collect this module minutes before running it."""
    global NOW
    NOW = datetime.now(UTC)


INT8 = CodecParams(scheme="int8", block_size=32, zstd_level=1)


def _params(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(12, 10, generator=gen),
        "layer.bias": torch.randn(12, generator=gen),
        "head.weight": torch.randn(3, 12, generator=gen),
    }


def _local(theta: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: t - 0.01 * torch.randn(t.shape, generator=gen) for name, t in theta.items()}


def _shapes(theta: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in theta.items()}


def _store_deltas(
    blobs: BlobStore, theta: dict[str, torch.Tensor]
) -> tuple[list[DeltaSource], dict[str, dict[str, torch.Tensor]]]:
    sources, decoded = [], {}
    for region, seed, tokens in (("us-east", 2, 300), ("eu-west", 1, 100)):
        delta = pseudo_gradient(theta, _local(theta, seed))
        stream = encode_stream(delta, INT8, chunk_elements=64)
        digest = blobs.put(stream.to_bytes())
        sources.append(DeltaSource(region, tokens, digest))
        decoded[region] = decode(stream.frames())
    return sources, decoded


def test_mean_delta_is_the_token_weighted_mean_in_sorted_order(tmp_path: Path) -> None:
    blobs = FsBlobStore(tmp_path / "blobs")
    theta = _params(0)
    sources, decoded = _store_deltas(blobs, theta)
    mean = mean_delta(blobs, _shapes(theta), sources, 4 * 200).delta
    for name in theta:
        # eu-west first (sorted), each scaled then summed, then divided: the same ops.
        expected = (
            torch.zeros_like(theta[name]).reshape(-1)
            + decoded["eu-west"][name].reshape(-1) * 100.0
            + decoded["us-east"][name].reshape(-1) * 300.0
        ) / 400.0
        assert torch.equal(mean[name], expected.reshape(theta[name].shape))


def test_a_late_delta_weighs_its_tokens_discounted_by_its_staleness(tmp_path: Path) -> None:
    blobs = FsBlobStore(tmp_path / "blobs")
    theta = _params(0)
    sources, decoded = _store_deltas(blobs, theta)
    late = replace(sources[0], round=1, staleness=2)  # us-east's 300 tokens, 2 rounds late
    order = ["eu-west", "us-east@1"]
    mean = mean_delta(blobs, _shapes(theta), [sources[1], late], 4 * 200, order=order).delta
    for name in theta:
        expected = (
            torch.zeros_like(theta[name]).reshape(-1)
            + decoded["eu-west"][name].reshape(-1) * 100.0
            + decoded["us-east"][name].reshape(-1) * 100.0
        ) / 200.0
        assert torch.equal(mean[name], expected.reshape(theta[name].shape))


def test_update_reconstructs_the_coordinators_parameters_bit_for_bit() -> None:
    theta = _params(0)
    mean = pseudo_gradient(theta, _local(theta, 5))
    optimizer = OuterOptimizer(OuterOptimizerConfig(lr=0.7, momentum=0.9, momentum_warmup_rounds=0))
    first = publication_step(theta, mean, optimizer.state_dict(), None, INT8)
    received = decode(first.stream.to_bytes())  # what a region downloads
    assert all(torch.equal(first.params[n], apply_update(theta, received)[n]) for n in theta)
    for name in theta:
        # The published update is θ_{r+1} - θ_r up to one fp32 rounding of the addition.
        assert torch.allclose(received[name], first.params[name] - theta[name], rtol=0, atol=1e-6)
        # Error feedback keeps exactly what quantization lost.
        intended = first.residual[name] + received[name]
        target_step = -0.7 * (mean[name] + 0.9 * mean[name])
        assert torch.allclose(intended, target_step, rtol=1e-5, atol=1e-7)
    assert any(bool(r.abs().max() > 0) for r in first.residual.values())
    # The next round carries the residual into its update and moves the momentum.
    second = publication_step(first.params, mean, first.optimizer_state, first.residual, INT8)
    received2 = decode(second.stream.frames())
    assert all(
        torch.equal(second.params[n], apply_update(first.params, received2)[n]) for n in theta
    )
    assert second.optimizer_state["steps"] == 2


def test_the_default_step_gives_the_bits_of_the_shared_ops_and_keeps_its_inputs() -> None:
    theta = _params(0)
    mean = pseudo_gradient(theta, _local(theta, 5))
    optimizer = OuterOptimizer(OuterOptimizerConfig(lr=0.7, momentum=0.9))
    first = publication_step(theta, mean, optimizer.state_dict(), None, INT8)
    kept = {
        "theta": {n: t.clone() for n, t in first.params.items()},
        "residual": {n: t.clone() for n, t in first.residual.items()},
        "mean": {n: t.clone() for n, t in mean.items()},
    }
    handed = dict(mean)
    second = publication_step(
        first.params, handed, first.optimizer_state, first.residual, INT8, consume_mean=True
    )
    assert handed == {}  # consumed once the step used it
    # The same computation with the shared, out-of-place ops of geofed.deltas.
    reference = OuterOptimizer.from_state_dict(first.optimizer_state)
    target = reference.step(kept["theta"], kept["mean"])
    intended = update_to_publish(kept["theta"], target, kept["residual"])
    assert second.stream.to_bytes() == encode_stream(intended, INT8).to_bytes()
    decoded = decode(second.stream.frames())
    expected_residual = feedback_residual(intended, decoded)
    expected_params = apply_update(kept["theta"], decoded)
    for name in theta:
        assert torch.equal(second.params[name], expected_params[name])
        assert torch.equal(second.residual[name], expected_residual[name])
        # Inputs untouched: the previous state and the caller's mean.
        assert torch.equal(first.params[name], kept["theta"][name])
        assert torch.equal(first.residual[name], kept["residual"][name])
        assert torch.equal(mean[name], kept["mean"][name])
    moved = second.optimizer_state["momentum_buffers"]
    assert all(
        not torch.equal(moved[n], first.optimizer_state["momentum_buffers"][n]) for n in theta
    )


def _clone(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in tensors.items()}


def _cloned_state(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "momentum_buffers": _clone(state["momentum_buffers"])}


@pytest.mark.parametrize(
    "config",
    [
        OuterOptimizerConfig(lr=0.7, momentum=0.9),  # warm-up: momentum 0 at first
        OuterOptimizerConfig(lr=0.5, momentum=0.8, momentum_warmup_rounds=0),
        OuterOptimizerConfig(kind="average"),
    ],
)
def test_the_step_taken_in_place_gives_the_same_bits_in_the_inputs_own_tensors(
    config: OuterOptimizerConfig,
) -> None:
    theta, state, residual = _params(0), OuterOptimizer(config).state_dict(), None
    placed: dict[str, torch.Tensor] = _clone(theta)
    placed_state, placed_residual = _cloned_state(state), None
    for round_ in range(4):  # the first step (no buffer), then momentum and a residual
        mean = pseudo_gradient(theta, _local(theta, 10 + round_))
        expected = publication_step(theta, mean, state, residual, INT8)
        handed = _clone(mean)
        own = {
            "theta": {n: t.data_ptr() for n, t in placed.items()},
            "mean": {n: t.data_ptr() for n, t in handed.items()},
            "momentum": {n: t.data_ptr() for n, t in placed_state["momentum_buffers"].items()},
        }
        handed_residual: dict[str, torch.Tensor] | None = (
            None if placed_residual is None else dict(placed_residual)
        )
        got = publication_step(placed, handed, placed_state, handed_residual, INT8, in_place=True)
        assert handed == {}
        assert not handed_residual  # let go once carried into the update
        assert got.stream.to_bytes() == expected.stream.to_bytes()
        for name in theta:
            assert torch.equal(got.params[name], expected.params[name])
            assert torch.equal(got.residual[name], expected.residual[name])
            # θ_{r+1} in θ_r's tensors, the new residual in the mean's.
            assert got.params[name].data_ptr() == own["theta"][name]
            assert got.residual[name].data_ptr() == own["mean"][name]
        moved = got.optimizer_state["momentum_buffers"]
        wanted = expected.optimizer_state["momentum_buffers"]
        assert moved.keys() == wanted.keys()
        for name in moved:
            assert torch.equal(moved[name], wanted[name])
            if name in own["momentum"]:
                assert moved[name].data_ptr() == own["momentum"][name]
        theta, state, residual = expected.params, expected.optimizer_state, expected.residual
        placed, placed_state = got.params, got.optimizer_state
        placed_residual = got.residual


def test_a_streaming_fragment_stepped_in_place_leaves_the_other_tensors_bit_for_bit() -> None:
    theta = _params(0)
    state = OuterOptimizer(OuterOptimizerConfig(lr=0.5, momentum=0.8)).state_dict()
    fragment = ["layer.weight", "head.weight"]
    mean = {n: t for n, t in pseudo_gradient(theta, _local(theta, 7)).items() if n in fragment}
    expected = publication_step(theta, mean, state, None, INT8, names=fragment, own_steps=0)
    placed = _clone(theta)
    bias = placed["layer.bias"]
    got = publication_step(
        placed, _clone(mean), state, None, INT8, names=fragment, own_steps=0, in_place=True
    )
    assert list(got.params) == list(theta)
    for name in theta:
        assert torch.equal(got.params[name], expected.params[name])
        assert got.params[name].data_ptr() == placed[name].data_ptr()
    assert torch.equal(bias, theta["layer.bias"])
    assert got.residual.keys() == expected.residual.keys() == set(fragment)


def test_tensors_sharing_memory_are_stepped_out_of_place_and_left_as_they_were() -> None:
    theta = _params(0)
    theta["tied.weight"] = theta["layer.weight"]  # one tensor under two names
    kept = _clone(theta)
    mean = pseudo_gradient(kept, _local(kept, 5))
    state = OuterOptimizer(OuterOptimizerConfig(kind="average")).state_dict()
    expected = publication_step(kept, mean, state, None, INT8)
    got = publication_step(theta, _clone(mean), state, None, INT8, in_place=True)
    for name in theta:
        assert torch.equal(got.params[name], expected.params[name])
        assert torch.equal(theta[name], kept[name])  # not taken twice in one tensor


def test_a_step_in_place_refuses_bad_input_before_writing_anything() -> None:
    theta = _params(0)
    kept = _clone(theta)
    state = OuterOptimizer(OuterOptimizerConfig(lr=0.5, momentum=0.8)).state_dict()
    mean = pseudo_gradient(theta, _local(theta, 5))
    mean["head.weight"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        publication_step(theta, mean, state, None, INT8, in_place=True)
    with pytest.raises(TypeError, match="own dict"):
        publication_step(theta, _ReadOnly(mean), state, None, INT8, in_place=True)
    for name in theta:
        assert torch.equal(theta[name], kept[name])


class _ReadOnly(Mapping[str, torch.Tensor]):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def test_lossless_codec_leaves_no_residual() -> None:
    theta = _params(0)
    mean = pseudo_gradient(theta, _local(theta, 5))
    config = OuterOptimizerConfig(kind="average")
    fp32 = CodecParams(scheme="fp32")
    result = publication_step(theta, mean, OuterOptimizer(config).state_dict(), None, fp32)
    for name in theta:
        assert torch.equal(result.residual[name], torch.zeros_like(theta[name]))
        assert torch.allclose(result.params[name], theta[name] - mean[name], rtol=0, atol=1e-6)


def test_phase_hook_sees_every_step_in_order_and_changes_nothing() -> None:
    theta = _params(0)
    mean = pseudo_gradient(theta, _local(theta, 5))
    state = OuterOptimizer(OuterOptimizerConfig()).state_dict()
    entered: list[str] = []

    @contextlib.contextmanager
    def phase(name: str) -> Iterator[None]:
        entered.append(name)
        yield

    measured = publication_step(theta, mean, state, None, INT8, phase=phase)
    plain = publication_step(theta, mean, state, None, INT8)
    assert tuple(entered) == PUBLICATION_PHASES
    assert measured.stream.to_bytes() == plain.stream.to_bytes()
    for name in theta:
        assert torch.equal(measured.params[name], plain.params[name])
        assert torch.equal(measured.residual[name], plain.residual[name])


def _publishing(tmp_path: Path, snapshot_every: int = 2) -> tuple[JobPublishing, TrustBundle]:
    fed = make_federation(tmp_path / "fed")
    provenance = (
        ArtifactProvenance(region="eu-west", jurisdiction="EU", datasets=("eu-a",)),
        ArtifactProvenance(region="us-east", jurisdiction="US", datasets=("us-b",)),
    )
    job = job_publishing(
        tmp_path,
        _shapes(_params(0)),
        INT8,
        snapshot_every=snapshot_every,
        provenance=provenance,
        federation=fed,
    )
    return job, fed.bundle()


def test_published_round_is_signed_stored_and_reproducible(tmp_path: Path) -> None:
    job, bundle = _publishing(tmp_path)
    theta = _params(0)
    optimizer = OuterOptimizer(OuterOptimizerConfig())
    state, pointers, snapshot = publish_initial(job, theta, optimizer, NOW)
    assert snapshot.round == 0
    assert job.params_store.load(pointers).params_hash == parameters_vector_hash(theta)
    sources, _ = _store_deltas(job.deltas, theta)

    published = publish_round(job, state, sources, NOW)

    bundle_bytes = job.location.path_of(published.update.bundle_digest).read_bytes()
    manifest_bytes, stream = split_bundle(bundle_bytes)
    signed = SignedManifest.from_bytes(manifest_bytes)
    assert signed.verify(bundle, now=NOW) == job.signer.identity
    manifest = signed.manifest
    assert (manifest.kind, manifest.round, manifest.base_hash) == (
        ArtifactKind.GLOBAL_UPDATE,
        0,
        state.params_hash,
    )
    reconstructed = apply_update(theta, decode(stream))
    assert parameters_vector_hash(reconstructed) == manifest.parameters_hash
    assert manifest.parameters_hash == published.state.params_hash
    assert job.params_store.load(published.pointers).params_hash == published.state.params_hash
    # snapshot_every=2: θ_1 gets no snapshot, the chain is snapshot 0 + update 0.
    assert published.snapshot is None
    assert [(e.kind, e.round) for e in job.location.store.entries("job-1")] == [
        (EntryKind.SNAPSHOT, 0),
        (EntryKind.UPDATE, 0),
    ]
    # A coordinator that crashed before committing recomputes the round: same stream,
    # the recorded artifact is reused, and θ_{r+1} is the same bits.
    again = publish_round(job, state, list(reversed(sources)), NOW)
    assert again.update == published.update
    assert again.state.params_hash == published.state.params_hash
    second = publish_round(job, published.state, sources, NOW)
    assert second.snapshot is not None
    assert second.snapshot.round == 2


def test_publishing_nothing_is_refused(tmp_path: Path) -> None:
    job, _ = _publishing(tmp_path)
    state = WorkingState.initial(_params(0), OuterOptimizer().state_dict())
    with pytest.raises(ValueError, match="no delta"):
        publish_round(job, state, [], NOW)
