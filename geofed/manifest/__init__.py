"""Signed artifact manifests: per-chunk digests, provenance, producer signature."""

from geofed.manifest.chunks import chunk_records, verify_chunk, verify_chunks
from geofed.manifest.errors import (
    BadSignature,
    ChunkDigestMismatch,
    MalformedManifest,
    ManifestError,
    ProducerMismatch,
    UnknownChunk,
    UntrustedSigner,
)
from geofed.manifest.model import (
    FORMAT_VERSION,
    SIGNED_KINDS,
    ChunkRecord,
    CodecParams,
    Manifest,
    Provenance,
    TensorSpec,
    canonical_json,
)
from geofed.manifest.signed import MAX_SIGNED_MANIFEST_BYTES, SignedManifest, sign_manifest

__all__ = [
    "FORMAT_VERSION",
    "MAX_SIGNED_MANIFEST_BYTES",
    "SIGNED_KINDS",
    "BadSignature",
    "ChunkDigestMismatch",
    "ChunkRecord",
    "CodecParams",
    "MalformedManifest",
    "Manifest",
    "ManifestError",
    "ProducerMismatch",
    "Provenance",
    "SignedManifest",
    "TensorSpec",
    "UnknownChunk",
    "UntrustedSigner",
    "canonical_json",
    "chunk_records",
    "sign_manifest",
    "verify_chunk",
    "verify_chunks",
]
