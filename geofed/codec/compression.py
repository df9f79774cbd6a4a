"""zstd for chunk payloads: frames that declare their size, and bounded decompression."""

from __future__ import annotations

import torch
import zstandard

from geofed.codec.errors import CorruptChunk, DecodedSizeExceeded
from geofed.codec.wire import Bytes


def new_compressor(level: int) -> zstandard.ZstdCompressor:
    """A compressor whose frames declare their content size (not thread-safe)."""
    return zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)


def decompress_exact(
    decompressor: zstandard.ZstdDecompressor, frame: Bytes, size: int, label: str
) -> torch.Tensor:
    """Decompress one zstd frame of exactly ``size`` bytes into a writable uint8 tensor.

    The frame's declared content size is checked before anything is allocated, and the
    output is capped at ``size``: a frame that claims, hides or produces more is refused
    (:class:`DecodedSizeExceeded` or :class:`CorruptChunk`, naming ``label``) without
    being expanded.
    """
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise CorruptChunk(f"{label}: bad zstd frame header: {exc}") from exc
    if declared < 0:
        raise CorruptChunk(f"{label}: zstd frame does not declare its content size")
    if declared != size:
        error = DecodedSizeExceeded if declared > size else CorruptChunk
        raise error(f"{label}: zstd frame declares {declared} bytes, not {size}")
    try:
        raw = decompressor.decompress(frame, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptChunk(f"{label}: zstd: {exc}") from exc
    if len(raw) != size:
        raise CorruptChunk(f"{label}: zstd frame holds {len(raw)} bytes, not {size}")
    # A writable copy: torch warns on tensors over read-only memory.
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)
