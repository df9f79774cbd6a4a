"""Checking chunk bytes against the digests a manifest records."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from geofed.manifest.errors import ChunkDigestMismatch, UnknownChunk
from geofed.manifest.model import ChunkRecord, Manifest

Bytes = bytes | bytearray | memoryview


def chunk_records(chunks: Iterable[Bytes]) -> tuple[ChunkRecord, ...]:
    """Records for ``chunks`` in stream order, for building a manifest."""
    return tuple(ChunkRecord.of(chunk) for chunk in chunks)


def verify_chunk(manifest: Manifest, index: int, data: Bytes) -> None:
    """Raise unless ``data`` is exactly chunk ``index`` of ``manifest``."""
    if not 0 <= index < len(manifest.chunks):
        raise UnknownChunk(f"chunk {index} does not exist; the manifest has {len(manifest.chunks)}")
    record = manifest.chunks[index]
    size = len(data) if not isinstance(data, memoryview) else data.nbytes
    if size != record.size:
        raise ChunkDigestMismatch(
            f"chunk {index} has {size} bytes; the manifest records {record.size}"
        )
    digest = hashlib.sha256(data).hexdigest()
    if not hmac.compare_digest(digest, record.sha256):
        raise ChunkDigestMismatch(
            f"chunk {index} has sha256 {digest}; the manifest records {record.sha256}"
        )


def verify_chunks(manifest: Manifest, chunks: Iterable[Bytes]) -> None:
    """Raise unless ``chunks`` are exactly the manifest's chunks, all of them, in order."""
    count = 0
    for index, data in enumerate(chunks):
        verify_chunk(manifest, index, data)
        count += 1
    if count != len(manifest.chunks):
        raise ChunkDigestMismatch(
            f"stream has {count} chunks; the manifest records {len(manifest.chunks)}"
        )
