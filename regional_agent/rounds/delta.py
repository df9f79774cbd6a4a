"""One round's delta: pseudo-gradient, error feedback, encoding, and its signed manifest.

Workers asked for it (:class:`regional_agent.handoff.messages.DeltaRequest`) hand over the delta
already quantized and sealed, in a stream file; :func:`check_worker_delta` checks it
against θ. :func:`encode_delta` forms and encodes a delta from trained parameters.

Pure computation on tensors (no clock read; a worker's stream is read, never written): the
agent runs :func:`encode_delta` in a worker thread, never on its event loop. The residual
is carried in a *copy* of the error-feedback state, so the caller's state advances only
when it decides the delta was delivered (see
:meth:`regional_agent.state.JobDirectory.promote`). Whether the delta may leave the region
at all is :mod:`regional_agent.rounds.residency`'s decision.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

import torch
from torch import Tensor

from geofed.codec import (
    DEFAULT_CHUNK_ELEMENTS,
    EncodedStream,
    ErrorFeedback,
    TensorLayout,
)
from geofed.codec_params import CodecParams
from geofed.deltas import pseudo_gradient
from geofed.lineage import Software
from geofed.manifest import (
    ArtifactProvenance,
    EncodedArtifact,
    Manifest,
    SignedManifest,
    build_manifest,
    sign_manifest,
)
from geofed.params import shapes_of
from geofed.training_config import TrainingConfig
from geofed.types import ArtifactKind, Identity
from regional_agent.credentials import Credentials
from regional_agent.handoff.delta_stream import DeltaStream
from regional_agent.handoff.delta_terms import UnusableDelta


@dataclass(frozen=True)
class EncodedDelta:
    """An encoded pseudo-gradient and the residual it leaves for the next round."""

    stream: EncodedStream
    feedback: ErrorFeedback

    @property
    def frames(self) -> list[bytes]:
        return list(self.stream.frames())

    @property
    def specs(self) -> list[TensorLayout]:
        return self.stream.specs

    @property
    def codec(self) -> CodecParams:
        return self.stream.codec

    @property
    def fp32_bytes(self) -> int:
        return self.stream.fp32_bytes

    @property
    def total_bytes(self) -> int:
        return self.stream.total_bytes


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
    training: TrainingConfig | None = None  # the job's training section, as announced
    base_eval: Mapping[str, float] | None = None  # the region's metrics of θ_base_round
    software: Software | None = None  # what trained it (geofed.lineage.local_software)
    #: Each dataset it trained on, fingerprinted (geofed.data.fingerprint), by name.
    data_fingerprints: Mapping[str, str] | None = None


def encode_delta(
    base: Mapping[str, Tensor],
    local: Mapping[str, Tensor],
    feedback: ErrorFeedback,
    codec: CodecParams,
    *,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    generator: torch.Generator | None = None,
) -> EncodedDelta:
    """Encode Δ = base - local with error feedback; ``feedback`` itself is not changed."""
    for name, tensor in local.items():
        if not tensor.is_floating_point():
            raise UnusableDelta(f"tensor {name!r} is {tensor.dtype}; a delta needs float tensors")
    try:
        delta = pseudo_gradient(base, local)
    except ValueError as exc:
        raise UnusableDelta(str(exc)) from None
    after = ErrorFeedback()
    after.load_state_dict(feedback.state_dict())
    stream = after.step(delta, codec, chunk_elements=chunk_elements, generator=generator)
    return EncodedDelta(stream=stream, feedback=after)


def check_worker_delta(
    base: Mapping[str, Tensor] | Mapping[str, tuple[int, ...]],
    stream: DeltaStream,
    codec: CodecParams,
    names: Sequence[str] | None = None,
) -> DeltaStream:
    """The delta stream rank 0 quantized and sealed (:mod:`regional_agent.worker.device_delta`),
    once its header says it is a float32 delta of θ's tensors (``base``: them, or their
    shapes) in the announced ``codec``.

    ``names`` (``overlap: streaming``: the round's fragment): the delta must hold exactly
    those tensors of ``base``, in that order; None: every tensor of ``base``.
    """
    if stream.codec != codec:
        raise UnusableDelta(f"the workers quantized with {stream.codec}, not {codec}")
    shapes = shapes_of(base)
    layouts = {spec.name: spec for spec in stream.specs}
    if names is None:
        if set(layouts) != set(shapes):
            differ = sorted(set(layouts) ^ set(shapes))
            raise UnusableDelta(f"the workers' delta and θ differ in tensors {differ}")
        expected: Sequence[str] = list(shapes)
    else:
        unknown = [name for name in names if name not in shapes]
        if unknown:
            raise UnusableDelta(f"the round's tensors {unknown} are not in θ")
        held = [spec.name for spec in stream.specs]
        if held != list(names):
            raise UnusableDelta(
                f"the workers' delta holds the tensors {held}, the round asks for exactly "
                f"{list(names)}, in that order"
            )
        expected = names
    for name in expected:
        shape = shapes[name]
        spec = layouts[name]
        if spec.dtype != "float32" or spec.shape != shape:
            raise UnusableDelta(
                f"the workers' delta has {name!r} as {spec.dtype} {spec.shape}, "
                f"θ as float32 {shape}"
            )
    return stream


def delta_manifest(origin: DeltaOrigin, stream: EncodedArtifact, *, now: datetime) -> Manifest:
    """The manifest of a ``model_delta`` (protocol: "What the signed manifests say")."""
    return build_manifest(
        kind=ArtifactKind.MODEL_DELTA,
        job=origin.job,
        round=origin.round,
        producer=origin.producer,
        stream=stream,
        provenance=(
            ArtifactProvenance(
                region=origin.producer.name,
                jurisdiction=origin.jurisdiction,
                datasets=tuple(sorted(origin.datasets)),
            ),
        ),
        created_at=now,
        base_round=origin.base_round,
        base_hash=origin.base_hash,
        tokens=origin.tokens,
        training=origin.training,
        base_eval=origin.base_eval,
        software=origin.software,
        data_fingerprints=origin.data_fingerprints,
    )


def sign_delta(manifest: Manifest, credentials: Credentials) -> SignedManifest:
    """Sign ``manifest`` with the region's key."""
    return sign_manifest(manifest, credentials.private_key, credentials.certificate)
