"""One round's delta: pseudo-gradient, error feedback, encoding, and its signed manifest.

Pure computation on tensors (no I/O, no clock read): the agent runs :func:`encode_delta`
in a worker thread, never on its event loop. The residual is carried in a *copy* of the
error-feedback state, so the caller's state advances only when it decides the delta was
delivered (see :meth:`regional_agent.state.JobState.promote`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

import torch
from torch import Tensor

from geofed.codec import CodecConfig, ErrorFeedback, TensorSpec
from geofed.control import CodecParams
from geofed.deltas import pseudo_gradient
from geofed.manifest import (
    ChunkRecord,
    Manifest,
    Provenance,
    SignedManifest,
    chunk_records,
    sign_manifest,
)
from geofed.manifest import CodecParams as ManifestCodec
from geofed.manifest import TensorSpec as ManifestTensor
from geofed.types import ArtifactKind, Identity
from policies import Decision, Endpoint, PolicySet, Transfer, decide_transfer
from policies import Provenance as PolicyProvenance
from regional_agent.credentials import Credentials


class DeltaError(ValueError):
    """The trained parameters cannot form a delta of the base (names, dtypes, shapes)."""


@dataclass(frozen=True)
class EncodedDelta:
    """An encoded pseudo-gradient and the residual it leaves for the next round."""

    frames: list[bytes]
    specs: list[TensorSpec]
    config: CodecConfig
    feedback: ErrorFeedback
    fp32_bytes: int

    @property
    def total_bytes(self) -> int:
        return sum(len(frame) for frame in self.frames)

    @property
    def records(self) -> tuple[ChunkRecord, ...]:
        return chunk_records(self.frames)


@dataclass(frozen=True, slots=True)
class DeltaOrigin:
    """What the manifest says about where a delta comes from and what it weighs."""

    job: str
    round: int
    base_round: int
    base_hash: str
    tokens: int
    producer: Identity
    jurisdiction: str
    datasets: Sequence[str]


def codec_config(params: CodecParams) -> CodecConfig:
    """The codec configuration an announcement's codec parameters name."""
    return CodecConfig(
        scheme=params.scheme,
        block_size=params.block_size,
        zstd_level=params.zstd_level,
        stochastic_rounding=params.stochastic_rounding,
    )


def rounding_generator(job: str, round_: int, region: str) -> torch.Generator:
    """A generator seeded from (job, round, region): re-encoding a round gives the same bytes."""
    digest = hashlib.sha256(f"geofed-delta/{job}/{round_}/{region}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def encode_delta(
    base: Mapping[str, Tensor],
    local: Mapping[str, Tensor],
    feedback: ErrorFeedback,
    config: CodecConfig,
    *,
    generator: torch.Generator | None = None,
) -> EncodedDelta:
    """Encode Δ = base - local with error feedback; ``feedback`` itself is not changed."""
    for name, tensor in local.items():
        if not tensor.is_floating_point():
            raise DeltaError(f"tensor {name!r} is {tensor.dtype}; a delta needs float tensors")
    try:
        delta = pseudo_gradient(base, local)
    except ValueError as exc:
        raise DeltaError(str(exc)) from None
    after = ErrorFeedback()
    after.load_state_dict(feedback.state_dict())
    stream = after.step(delta, config, generator=generator)
    return EncodedDelta(
        frames=list(stream.frames()),
        specs=list(stream.specs),
        config=config,
        feedback=after,
        fp32_bytes=stream.fp32_bytes,
    )


def delta_manifest(origin: DeltaOrigin, encoded: EncodedDelta, *, now: datetime) -> Manifest:
    """The manifest of a ``model_delta`` (protocol: "What the signed manifests say")."""
    records = encoded.records
    config = encoded.config
    return Manifest(
        kind=ArtifactKind.MODEL_DELTA,
        job=origin.job,
        round=origin.round,
        producer=origin.producer.uri,
        codec=ManifestCodec(
            scheme=config.scheme,
            block_size=config.block_size,
            zstd_level=config.zstd_level,
            stochastic_rounding=config.stochastic_rounding,
        ),
        tensors=tuple(
            ManifestTensor(name=spec.name, dtype=spec.dtype, shape=spec.shape)
            for spec in encoded.specs
        ),
        chunks=records,
        total_size=sum(record.size for record in records),
        provenance=(
            Provenance(
                region=origin.producer.name,
                jurisdiction=origin.jurisdiction,
                datasets=tuple(sorted(origin.datasets)),
            ),
        ),
        created_at=now,
        base_round=origin.base_round,
        base_hash=origin.base_hash,
        tokens=origin.tokens,
    )


def sign_delta(manifest: Manifest, credentials: Credentials) -> SignedManifest:
    """Sign ``manifest`` with the region's key."""
    return sign_manifest(manifest, credentials.private_key, credentials.certificate)


def export_decision(policies: PolicySet, region: str, datasets: Sequence[str]) -> Decision:
    """May a ``model_delta`` of ``region`` (trained on ``datasets``) go to the coordinator?"""
    transfer = Transfer(
        kind=ArtifactKind.MODEL_DELTA,
        source=Endpoint.of_region(region, policies.jurisdiction_of(region)),
        destination=Endpoint.coordinator(),
        provenance=PolicyProvenance.of({region: datasets}),
    )
    return decide_transfer(policies, transfer)
