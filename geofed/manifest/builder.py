"""Building the manifest of an encoded stream: the one place every producer goes through.

The coordinator (global updates, checkpoint snapshots), a regional agent (its deltas) and
the test federation all describe what they encoded with :func:`build_manifest`, so a
manifest's chunk records, sizes and tensor list are derived the same way everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Protocol

from pydantic import JsonValue

from geofed.codec_params import CodecParams
from geofed.lineage import Software
from geofed.manifest.chunks import Bytes, chunk_records
from geofed.manifest.model import ArtifactProvenance, Manifest, ManifestTensor
from geofed.training_config import TrainingConfig
from geofed.types import ArtifactKind, Identity

__all__ = ["EncodedArtifact", "EncodedTensor", "build_manifest"]


class EncodedTensor(Protocol):
    """What a manifest records of one tensor of a stream (the codec's tensor layout)."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


class EncodedArtifact(Protocol):
    """What a manifest records of an encoded stream (the codec's ``EncodedStream``)."""

    @property
    def codec(self) -> CodecParams: ...

    @property
    def specs(self) -> Sequence[EncodedTensor]: ...

    def frames(self) -> Iterable[Bytes]:
        """The stream's frames in order: header, chunks, trailer."""
        ...


def build_manifest(
    *,
    kind: ArtifactKind,
    job: str,
    round: int,
    producer: Identity,
    stream: EncodedArtifact,
    provenance: Iterable[ArtifactProvenance],
    created_at: datetime,
    base_round: int | None = None,
    base_hash: str | None = None,
    tokens: int | None = None,
    parameters_hash: str | None = None,
    training: TrainingConfig | None = None,
    base_eval: Mapping[str, float] | None = None,
    software: Software | None = None,
    lineage: Mapping[str, JsonValue] | None = None,
    data_fingerprints: Mapping[str, str] | None = None,
) -> Manifest:
    """The manifest of ``stream``: its codec, its tensors, one chunk record per frame."""
    chunks = chunk_records(stream.frames())
    return Manifest(
        kind=kind,
        job=job,
        round=round,
        producer=producer.uri,
        codec=stream.codec,
        tensors=tuple(
            ManifestTensor(name=tensor.name, dtype=tensor.dtype, shape=tuple(tensor.shape))
            for tensor in stream.specs
        ),
        chunks=chunks,
        total_size=sum(chunk.size for chunk in chunks),
        provenance=tuple(provenance),
        created_at=created_at,
        base_round=base_round,
        base_hash=base_hash,
        tokens=tokens,
        parameters_hash=parameters_hash,
        training=training,
        software=software,
        lineage=None if lineage is None else dict(lineage),
        base_eval=None if base_eval is None else dict(base_eval),
        data_fingerprints=None if data_fingerprints is None else dict(data_fingerprints),
    )
