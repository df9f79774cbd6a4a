"""Signed artifact manifests: per-chunk digests, provenance, producer signature."""

from geofed.canonical_json import canonical_json
from geofed.manifest.builder import EncodedArtifact, EncodedTensor, build_manifest
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
    ArtifactProvenance,
    ChunkRecord,
    Manifest,
    ManifestTensor,
)
from geofed.manifest.signed import MAX_SIGNED_MANIFEST_BYTES, SignedManifest, sign_manifest

__all__ = [
    "FORMAT_VERSION",
    "MAX_SIGNED_MANIFEST_BYTES",
    "SIGNED_KINDS",
    "ArtifactProvenance",
    "BadSignature",
    "ChunkDigestMismatch",
    "ChunkRecord",
    "EncodedArtifact",
    "EncodedTensor",
    "MalformedManifest",
    "Manifest",
    "ManifestError",
    "ManifestTensor",
    "ProducerMismatch",
    "SignedManifest",
    "UnknownChunk",
    "UntrustedSigner",
    "build_manifest",
    "canonical_json",
    "chunk_records",
    "sign_manifest",
    "verify_chunk",
    "verify_chunks",
]
