"""The manifest of one artifact: what it is, who made it, how to decode it, its chunks.

The manifest is the unit of trust of the data plane: its per-chunk SHA-256 digests let a
receiver verify every chunk as it streams in, and its signature (see
:mod:`geofed.manifest.signed`) ties all of it to the producer's federation identity.
The codec and the manifest meet only in data: the codec parameters are the shared
:class:`~geofed.codec_params.CodecParams` and tensors are plain fields here, so this
package does not import the codec.

The canonical form (:meth:`Manifest.canonical_bytes`) is JSON with sorted keys, no
whitespace, UTF-8; it is what gets signed and what :meth:`Manifest.digest` hashes. Fields
added to format 1 after manifests were first signed (``training``, ``base_eval``,
``software``, ``lineage``, ``data_fingerprints``) are left out of it while unset, so a
manifest signed before they existed still verifies.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Annotated, Final, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    Strict,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from geofed.canonical_json import canonical_json
from geofed.codec_params import CodecParams
from geofed.lineage import Software
from geofed.training_config import TrainingConfig
from geofed.types import ArtifactKind, Identity, validate_name

FORMAT_VERSION: Final = 1

SIGNED_KINDS: Final = frozenset(
    {
        ArtifactKind.MODEL_DELTA,
        ArtifactKind.GLOBAL_UPDATE,
        ArtifactKind.GLOBAL_CHECKPOINT,
        ArtifactKind.REGIONAL_CHECKPOINT,
    }
)

Sha256Hex = Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")]
Count = Annotated[StrictInt, Field(ge=0)]
# Printable ASCII without spaces: tensor names like "layers.0.attn.q_proj.weight".
Label = Annotated[StrictStr, Field(pattern=r"^[!-~]{1,512}$")]
MetricName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.]{0,63}$")]
FiniteNumber = Annotated[float, Strict(), Field(allow_inf_nan=False)]
#: Fields added to format 1 later: omitted from the wire and canonical forms while None.
_LATER_OPTIONAL: Final = frozenset(
    {"training", "base_eval", "software", "lineage", "data_fingerprints"}
)
DatasetName = Annotated[StrictStr, Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ManifestTensor(_Record):
    """One tensor of the artifact, in stream order."""

    name: Label
    dtype: Annotated[StrictStr, Field(pattern=r"^[a-z0-9_]{1,32}$")]
    shape: Annotated[tuple[Count, ...], Field(max_length=32)]


class ChunkRecord(_Record):
    """Digest and size of one chunk of the encoded stream."""

    sha256: Sha256Hex
    size: Count

    @classmethod
    def of(cls, data: bytes | bytearray | memoryview) -> ChunkRecord:
        """The record describing ``data``."""
        return cls(sha256=hashlib.sha256(data).hexdigest(), size=len(data))


class ArtifactProvenance(_Record):
    """A region that contributed to the artifact, with its jurisdiction and datasets."""

    region: StrictStr
    jurisdiction: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
    datasets: tuple[Label, ...]

    @field_validator("region")
    @classmethod
    def _region(cls, value: str) -> str:
        return validate_name("region", value)


class Manifest(_Record):
    """Describes one signed artifact; unknown fields are rejected."""

    format_version: Literal[1] = FORMAT_VERSION
    kind: ArtifactKind
    job: StrictStr
    round: Count
    producer: StrictStr = Field(description="SPIFFE URI of the signer")
    codec: CodecParams = Field(description="how the tensors were encoded")
    tensors: tuple[ManifestTensor, ...]
    chunks: tuple[ChunkRecord, ...] = Field(description="in stream order")
    total_size: Count = Field(description="sum of chunk sizes, bytes")
    provenance: tuple[ArtifactProvenance, ...]
    created_at: Annotated[AwareDatetime, Strict()]
    base_round: Count | None = Field(default=None, description="round of the base parameters")
    base_hash: Sha256Hex | None = Field(default=None, description="hash of the base parameters")
    tokens: Count | None = Field(default=None, description="weight of a delta")
    parameters_hash: Sha256Hex | None = Field(
        default=None, description="hash of the parameters after applying an update"
    )
    training: TrainingConfig | None = Field(
        default=None, description="the job's training section that trained a delta"
    )
    base_eval: Annotated[dict[MetricName, FiniteNumber], Field(max_length=32)] | None = Field(
        default=None,
        description="a delta's region's held-out metrics of its base parameters θ_base_round",
    )
    software: Software | None = Field(
        default=None, description="a delta's region's torch, geofed and task code versions"
    )
    lineage: dict[str, JsonValue] | None = Field(
        default=None, description="a global update's lineage record (geofed.lineage)"
    )
    data_fingerprints: Annotated[dict[DatasetName, Sha256Hex], Field(max_length=64)] | None = Field(
        default=None,
        description="a delta's region's fingerprint of each dataset it trained on "
        "(geofed.data.fingerprint: never a path or content)",
    )

    @field_validator("kind")
    @classmethod
    def _kind(cls, value: ArtifactKind) -> ArtifactKind:
        if value not in SIGNED_KINDS:
            allowed = ", ".join(sorted(SIGNED_KINDS))
            raise ValueError(f"artifact kind {value.value!r} has no manifest; use one of {allowed}")
        return value

    @field_validator("job")
    @classmethod
    def _job(cls, value: str) -> str:
        return validate_name("job", value)

    @field_validator("producer")
    @classmethod
    def _producer(cls, value: str) -> str:
        return Identity.parse(value).uri

    @field_validator("created_at")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        return value.astimezone(UTC)

    @field_validator("tensors")
    @classmethod
    def _unique_tensors(cls, value: tuple[ManifestTensor, ...]) -> tuple[ManifestTensor, ...]:
        seen: set[str] = set()
        for spec in value:
            if spec.name in seen:
                raise ValueError(f"tensor {spec.name!r} appears twice")
            seen.add(spec.name)
        return value

    @model_validator(mode="after")
    def _sizes_add_up(self) -> Manifest:
        actual = sum(chunk.size for chunk in self.chunks)
        if actual != self.total_size:
            raise ValueError(f"total_size is {self.total_size} but the chunks add up to {actual}")
        return self

    @property
    def producer_identity(self) -> Identity:
        return Identity.parse(self.producer)

    def to_json_dict(self) -> dict[str, object]:
        """The JSON form (later optional fields only when set)."""
        unset = {name for name in _LATER_OPTIONAL if getattr(self, name) is None}
        data: dict[str, object] = self.model_dump(mode="json", exclude=unset)
        return data

    def canonical_bytes(self) -> bytes:
        """Deterministic JSON (sorted keys, no whitespace, UTF-8): the signed bytes."""
        return canonical_json(self.to_json_dict())

    def digest(self) -> str:
        """SHA-256 hex of the canonical form: the manifest's content address."""
        return hashlib.sha256(self.canonical_bytes()).hexdigest()
