"""A delta's stream, checked before its file becomes a blob; its manifest, checked.

Commit verification decodes the whole stream once: every frame against the manifest, the
header's tensors and codec against the manifest and the job, every decoded value for
finiteness, the decoded size against the model's, its chunks side by side on every usable
CPU, the file hashed meanwhile. The stream's file then becomes its content-addressed blob,
and nothing is stored if any check fails. No decoded value is kept: a round
that folds deltas as they arrive decodes the stored stream again into its running sum
(:mod:`coordinator.aggregation.accumulator`), so uploads verified side by side hold no copy
of the model. CPU and disk work: run these in a worker thread.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path

from coordinator.aggregation.weighted import all_finite
from coordinator.errors import BadRequest
from coordinator.intake.delta_checks import DeltaExpectation, check_delta_manifest, verify_signature
from geofed.blobstore import FsBlobStore
from geofed.codec import (
    CorruptChunk,
    DecodedSizeExceeded,
    DecodeError,
    DigestMismatch,
    Piece,
    StreamDecoder,
)
from geofed.codec.stored import decode_stored
from geofed.manifest import ManifestError, ManifestTensor, SignedManifest
from geofed.pki import TrustBundle

__all__ = ["checked_manifest", "verify_and_store"]


def checked_manifest(
    body: bytes, expect: DeltaExpectation, bundle: TrustBundle, max_size: int
) -> tuple[SignedManifest, str]:
    """Parse, check and verify a delta manifest (CPU work: run it off the event loop)."""
    try:
        signed = SignedManifest.from_bytes(body, max_size=max_size)
    except ManifestError as exc:
        raise BadRequest(str(exc), "malformed_manifest") from None
    check_delta_manifest(signed, expect)
    verify_signature(signed, bundle, datetime.now(UTC))
    return signed, signed.manifest.digest()


def verify_and_store(
    path: Path,
    signed: SignedManifest,
    tensors: tuple[ManifestTensor, ...],
    blobs: FsBlobStore,
    *,
    workers: int = 1,
) -> tuple[str, int]:
    """Verify the stream stored at ``path`` and make the file the delta's blob
    (:meth:`FsBlobStore.adopt`); return (digest, size).

    Checks every frame against the manifest, the header's tensors and codec against the
    manifest and the job, every decoded value for finiteness, and the decoded size
    against the model's (the codec's layout has every element come once), its chunks
    decoded side by side on ``workers`` threads (:func:`geofed.codec.stored.decode_stored`).
    Raises the protocol's 400 errors; nothing is stored on error. No decoded value is
    kept: the round's sum decodes the stored stream again
    (:mod:`coordinator.aggregation.accumulator`).
    """
    manifest = signed.manifest
    numel = sum(math.prod(spec.shape) for spec in tensors)

    def finite(piece: Piece) -> None:
        if not all_finite(piece.values):
            raise BadRequest(
                f"tensor {piece.name!r} elements [{piece.offset}:"
                f"{piece.offset + piece.count}] hold NaN or Inf",
                "non_finite",
            )

    try:
        size = _size(path, [record.size for record in manifest.chunks])
        digest = decode_stored(
            path,
            finite,
            workers=workers,
            max_decoded_bytes=4 * numel,
            expected_digests=[record.sha256 for record in manifest.chunks],
            check_header=lambda decoder: _check_header(decoder, signed, tensors),
        )
    except DigestMismatch as exc:
        raise BadRequest(str(exc), "corrupt_chunk") from None
    except DecodedSizeExceeded as exc:
        raise BadRequest(str(exc), "decode_failed") from None
    except CorruptChunk as exc:
        # The codec refuses non-finite payloads as corrupt; the protocol names them apart.
        code = "non_finite" if "NaN or Inf" in str(exc) else "decode_failed"
        raise BadRequest(f"the stream does not decode: {exc}", code) from None
    except DecodeError as exc:
        raise BadRequest(f"the stream does not decode: {exc}", "decode_failed") from None
    blobs.adopt(path, digest)
    return digest, size


def _size(path: Path, sizes: list[int]) -> int:
    """The stream file's size, which must be that of its manifest's frames."""
    size = path.stat().st_size
    if size != sum(sizes):
        raise BadRequest(
            f"the stream has {size} bytes; its manifest's {len(sizes)} frames have {sum(sizes)}",
            "corrupt_chunk",
        )
    return size


def _check_header(
    decoder: StreamDecoder, signed: SignedManifest, tensors: tuple[ManifestTensor, ...]
) -> None:
    found = [(spec.name, spec.dtype, spec.shape) for spec in decoder.specs]
    wanted = [(spec.name, spec.dtype, tuple(spec.shape)) for spec in tensors]
    if found != wanted:
        raise BadRequest(
            "the stream header's tensors differ from the manifest's and the job's model",
            "shape_mismatch",
        )
    if decoder.codec != signed.manifest.codec:
        raise BadRequest(
            f"the stream header's codec {decoder.codec.as_dict()} differs from the manifest's",
            "codec_mismatch",
        )
