"""Errors of signed manifests; each has a stable ``code`` for HTTP answers and audit."""

from __future__ import annotations

from typing import ClassVar


class ManifestError(Exception):
    """Base of every error raised by :mod:`geofed.manifest`."""

    code: ClassVar[str] = "manifest_error"


class MalformedManifest(ManifestError):
    """Not a well-formed signed manifest: bad JSON, unknown or missing fields, bad values."""

    code: ClassVar[str] = "malformed_manifest"


class BadSignature(ManifestError):
    """The signature does not verify with the enclosed certificate's key."""

    code: ClassVar[str] = "bad_signature"


class UntrustedSigner(ManifestError):
    """The enclosed certificate is refused by the trust bundle; ``reason`` says why."""

    code: ClassVar[str] = "untrusted_signer"

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class ProducerMismatch(ManifestError):
    """The manifest names a producer other than the identity that signed it."""

    code: ClassVar[str] = "producer_mismatch"


class UnknownChunk(ManifestError):
    """A chunk index outside the manifest's chunk list."""

    code: ClassVar[str] = "unknown_chunk"


class ChunkDigestMismatch(ManifestError):
    """A chunk's bytes differ (digest or size) from what the manifest records."""

    code: ClassVar[str] = "chunk_digest_mismatch"
