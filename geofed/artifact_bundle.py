"""The artifact bundle: a signed manifest and the codec stream it describes, in one body.

Layout: ``b"GFA1"``, a 4-byte big-endian manifest length, the signed manifest bytes, then
the stream (the concatenation of the frames the manifest lists). Used for single-shot
uploads, published updates and checkpoint snapshots, so one file can be served with HTTP
``Range`` and resumed.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from typing import TypeVar

MAGIC = b"GFA1"
_HEADER = struct.Struct(">4sI")
_B = TypeVar("_B", bytes, memoryview)
#: A signed manifest lists one digest per frame; 64 MiB is far beyond any real one.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024


class BundleError(ValueError):
    """The bytes are not an artifact bundle."""


def bundle_prefix(manifest: bytes) -> bytes:
    """Return the bytes that precede the stream: magic, length, manifest."""
    if len(manifest) > MAX_MANIFEST_BYTES:
        raise BundleError(f"manifest of {len(manifest)} bytes exceeds {MAX_MANIFEST_BYTES}")
    return _HEADER.pack(MAGIC, len(manifest)) + manifest


def iter_bundle(manifest: bytes, frames: Iterable[bytes]) -> Iterator[bytes]:
    """Yield the bundle piece by piece (prefix, then each frame), for streaming writes."""
    yield bundle_prefix(manifest)
    yield from frames


def pack_bundle(manifest: bytes, frames: Iterable[bytes]) -> bytes:
    """Return the whole bundle as one ``bytes``."""
    return b"".join(iter_bundle(manifest, frames))


def manifest_length(head: bytes | memoryview) -> int:
    """Parse the first 8 bytes of a bundle and return the manifest length."""
    if len(head) < _HEADER.size:
        raise BundleError(f"bundle truncated: {len(head)} bytes, header needs {_HEADER.size}")
    magic, length = _HEADER.unpack_from(head)
    if magic != MAGIC:
        raise BundleError(f"not an artifact bundle: magic {magic!r}, expected {MAGIC!r}")
    if length > MAX_MANIFEST_BYTES:
        raise BundleError(f"manifest length {length} exceeds {MAX_MANIFEST_BYTES}")
    return int(length)


def split_bundle(data: _B) -> tuple[_B, _B]:
    """Split a whole bundle into (manifest bytes, stream bytes): slices of ``data``'s
    type (of a memoryview: views, not copies)."""
    length = manifest_length(data[: _HEADER.size])
    end = _HEADER.size + length
    if len(data) < end:
        raise BundleError(f"bundle truncated inside the manifest: {len(data)} < {end} bytes")
    return data[_HEADER.size : end], data[end:]


HEADER_SIZE = _HEADER.size
