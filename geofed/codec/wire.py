"""Frames on the wire: building and checking them, byte for byte.

The layout is documented in the package docstring (:mod:`geofed.codec`). This module
knows the bytes; it does not know tensors or zstd.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

from geofed.codec.errors import CorruptStream, InvalidConfig, UnsupportedVersion
from geofed.codec.layout import check_chunk_elements
from geofed.codec.tensors import TensorLayout
from geofed.codec_params import SCHEMES, CodecParams

MAGIC: Final = b"GFDC"
#: The version this encoder writes; decoders also read every version in SUPPORTED_VERSIONS.
VERSION: Final = 2
SUPPORTED_VERSIONS: Final = frozenset({1, 2})
PREFIX: Final = struct.Struct("<4sBBHQ")
# Version 1 wrote three zero bytes after the scheme; version 2 gives the first of them to
# the compression code (0 = zstd, so a version 1 chunk reads as a zstd chunk).
CHUNK_FIELDS: Final = struct.Struct("<QIBBHQQQ32s")
TRAILER_FIELDS: Final = struct.Struct("<QQQ32s")
TAG_SIZE: Final = 32
MAX_HEADER_BODY: Final = 64 << 20
SCHEME_CODES: Final[dict[str, int]] = {scheme: code for code, scheme in enumerate(SCHEMES)}

_HEADER_KEYS: Final = frozenset(
    {"scheme", "block_size", "zstd_level", "stochastic_rounding", "chunk_elements", "tensors"}
)

Bytes = bytes | bytearray | memoryview


class FrameKind(IntEnum):
    HEADER = 1
    CHUNK = 2
    TRAILER = 3


class Compression(IntEnum):
    """How a chunk's payload is stored in its frame (version 2; version 1 knows only ZSTD)."""

    ZSTD = 0
    NONE = 1


@dataclass(frozen=True, slots=True)
class Prefix:
    """The fixed fields that open every frame."""

    version: int
    kind: FrameKind
    body_len: int


@dataclass(frozen=True, slots=True)
class Sealed:
    """A finished frame and the sha256 of all its bytes."""

    data: bytes
    digest: bytes


@dataclass(frozen=True, slots=True)
class ChunkFields:
    """The fixed fields of a chunk frame's body (the zstd frame follows them)."""

    index: int
    tensor: int
    scheme_code: int
    offset: int
    count: int
    decoded_size: int
    header_digest: bytes
    compression: int = Compression.ZSTD
    reserved: int = 0


@dataclass(frozen=True, slots=True)
class TrailerFields:
    chunk_count: int
    total_elements: int
    total_bytes: int
    stream_digest: bytes


def seal(kind: FrameKind, parts: Sequence[Bytes], *, version: int = VERSION) -> Sealed:
    """Frame ``parts`` as one body: prefix, body, sha256 tag of prefix and body."""
    prefix = PREFIX.pack(MAGIC, version, kind, 0, sum(len(part) for part in parts))
    hasher = hashlib.sha256(prefix)
    for part in parts:
        hasher.update(part)
    tag = hasher.digest()
    # The digest of the whole frame continues the same hash: one pass over the payload.
    hasher.update(tag)
    return Sealed(b"".join([prefix, *parts, tag]), hasher.digest())


def frame_size(body_len: int) -> int:
    return PREFIX.size + body_len + TAG_SIZE


def parse_prefix(data: Bytes, where: str) -> Prefix:
    """Return the version, kind and body length of the frame starting ``data``."""
    magic, version, kind, flags, body_len = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise UnsupportedVersion(f"{where}: magic {bytes(magic)!r} is not {MAGIC!r}")
    if version not in SUPPORTED_VERSIONS:
        supported = ", ".join(str(v) for v in sorted(SUPPORTED_VERSIONS))
        raise UnsupportedVersion(
            f"{where}: wire-format version {version} (this decoder reads {supported})"
        )
    if kind not in FrameKind.__members__.values():
        raise CorruptStream(f"{where}: unknown frame kind {kind}")
    if flags:
        raise CorruptStream(f"{where}: reserved flags are {flags:#x}, not 0")
    return Prefix(version, FrameKind(kind), body_len)


def verify_tag(frame: memoryview, where: str) -> bytes:
    """Check a complete frame's tag; return the sha256 of the whole frame."""
    hasher = hashlib.sha256(frame[:-TAG_SIZE])
    tag = frame[-TAG_SIZE:]
    if hasher.digest() != tag:
        raise CorruptStream(f"{where}: sha256 tag does not match its contents")
    hasher.update(tag)
    return hasher.digest()


def header_body(codec: CodecParams, chunk_elements: int, specs: Sequence[TensorLayout]) -> bytes:
    document = {
        **codec.as_dict(),
        "chunk_elements": chunk_elements,
        "tensors": [[spec.name, spec.dtype, list(spec.shape)] for spec in specs],
    }
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode("ascii")


def parse_header_body(body: Bytes, where: str) -> tuple[CodecParams, int, list[TensorLayout]]:
    """Parse and validate a stream header body: codec parameters, chunk size, tensors.

    Raises :class:`CorruptStream` if the header is invalid.
    """
    try:
        document = json.loads(bytes(body).decode("ascii"))
    except (ValueError, RecursionError) as exc:
        raise CorruptStream(f"{where}: header is not ASCII JSON: {exc}") from exc
    if not isinstance(document, dict) or set(document) != _HEADER_KEYS:
        keys = sorted(document) if isinstance(document, dict) else type(document).__name__
        raise CorruptStream(f"{where}: header fields {keys} are not {sorted(_HEADER_KEYS)}")
    tensors = document.pop("tensors")
    if not isinstance(tensors, list):
        raise CorruptStream(f"{where}: 'tensors' is not a list")
    chunk_elements = document.pop("chunk_elements")
    try:
        codec = CodecParams(**document)
        chunk_elements = check_chunk_elements(chunk_elements, codec.block_size)
        specs = [_parse_spec(entry) for entry in tensors]
    except InvalidConfig as exc:
        raise CorruptStream(f"{where}: {exc}") from exc
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        duplicate = next(name for name in names if names.count(name) > 1)
        raise CorruptStream(f"{where}: tensor {duplicate!r} is listed twice")
    return codec, chunk_elements, specs


def _parse_spec(entry: object) -> TensorLayout:
    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], list)):
        raise InvalidConfig(f"tensor entry {entry!r} is not [name, dtype, [sizes...]]")
    name, dtype, shape = entry
    return TensorLayout(name, dtype, tuple(shape))


def chunk_fields(fields: ChunkFields) -> bytes:
    return CHUNK_FIELDS.pack(
        fields.index,
        fields.tensor,
        fields.scheme_code,
        fields.compression,
        fields.reserved,
        fields.offset,
        fields.count,
        fields.decoded_size,
        fields.header_digest,
    )


def parse_chunk_fields(body: Bytes) -> ChunkFields:
    index, tensor, scheme, compression, reserved, offset, count, size, digest = (
        CHUNK_FIELDS.unpack_from(body)
    )
    return ChunkFields(index, tensor, scheme, offset, count, size, digest, compression, reserved)


def trailer_body(fields: TrailerFields) -> bytes:
    return TRAILER_FIELDS.pack(
        fields.chunk_count, fields.total_elements, fields.total_bytes, fields.stream_digest
    )


def parse_trailer_body(body: Bytes) -> TrailerFields:
    return TrailerFields(*TRAILER_FIELDS.unpack_from(body))
