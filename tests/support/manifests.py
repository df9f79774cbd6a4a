"""An unsigned model-delta manifest with every field set, for the manifest tests."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from geofed.codec_params import CodecParams
from geofed.lineage import Software, TaskCode
from geofed.manifest import ArtifactProvenance, Manifest, ManifestTensor, chunk_records
from geofed.training_config import LrSchedule, TrainingConfig
from geofed.types import ArtifactKind
from tests.support.pki import Principal

#: The chunks :func:`make_manifest` describes.
CHUNKS = [bytes(range(256)) * 4, b"\x00" * 1000, b"tail"]


def make_manifest(signer: Principal, **changes: Any) -> Manifest:
    """A model-delta manifest of :data:`CHUNKS` by ``signer``; ``changes`` replace fields."""
    fields: dict[str, Any] = {
        "kind": ArtifactKind.MODEL_DELTA,
        "job": "tiny-lm",
        "round": 7,
        "producer": signer.identity.uri,
        "codec": CodecParams(
            scheme="int8", block_size=128, zstd_level=1, stochastic_rounding=False
        ),
        "tensors": (
            ManifestTensor(name="embed.weight", dtype="float32", shape=(64, 32)),
            ManifestTensor(name="head.bias", dtype="float32", shape=(64,)),
        ),
        "chunks": chunk_records(CHUNKS),
        "total_size": sum(len(c) for c in CHUNKS),
        "provenance": (
            ArtifactProvenance(region="eu-west", jurisdiction="EU", datasets=("c4-eu",)),
        ),
        "created_at": datetime(2030, 1, 2, 3, 4, 5, 678000, tzinfo=UTC),
        "base_round": 6,
        "base_hash": "ab" * 32,
        "tokens": 4096,
        "parameters_hash": None,
        "training": TrainingConfig(
            precision="bf16",
            grad_clip_norm=1.0,
            lr_schedule=LrSchedule(kind="warmup_cosine", warmup_steps=10, min_lr_ratio=0.1),
        ),
        "base_eval": {"val_loss": 2.5, "val_bits_per_byte": 3.6067},
        "software": Software(
            torch="2.13.0",
            geofed="0.1.0",
            python="3.11.2",
            task=TaskCode(
                spec="geofed.examples.charlm:CharLMTask",
                package="geofed",
                version="0.1.0",
                fingerprint="12" * 32,
            ),
        ),
        "lineage": {"format": 1, "contributors": [{"region": "eu-west", "tokens": 4096}]},
        "data_fingerprints": {"c4-eu": "5e" * 32},
    }
    fields.update(changes)
    return Manifest(**fields)
