"""zstd for chunk payloads: when it pays, frames that declare their size, bounded decompression.

Int8 codes of dense deltas are close to their entropy bound: zstd gains about 1.01-1.06x
on those of Gaussian or trained-model deltas and about 1.3x on heavy-tailed ones (Student's
t, 2 degrees of freedom), all of it from Huffman-coding the literals, at about 0.75 ms to
compress and 0.5 ms to decompress a 1M-element chunk on one core, twice what quantizing
and dequantizing it cost. Int4 codes, float32 and sparse codes gain 1.1-2x or more
(99% zeros: about 30x). The encoder's ``auto`` policy therefore decides per chunk: a
float32 or int4 payload is compressed unless zstd would not shrink it at all (int4 is
the scheme chosen for the fewest bytes); an int8 payload is compressed only if zstd
shrinks a sample of it (:data:`SAMPLE_WINDOWS` windows of :data:`SAMPLE_WINDOW` bytes
spread over it; the whole payload when it is no larger) and then the whole payload by at
least :data:`MIN_ZSTD_GAIN` (a third fewer bytes), and otherwise stored as it is. Callers
that value every byte over CPU time pick ``zstd``. The sample costs about 3% of
compressing a 1M-element int8 chunk. The decision is a pure function of the payload and
the level, so encoding stays deterministic.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

import torch
import zstandard

from geofed.codec.errors import CorruptChunk, DecodedSizeExceeded, EncodeError
from geofed.codec.wire import Bytes, Compression
from geofed.codec_params import Scheme

CompressionPolicy = Literal["auto", "zstd", "none"]
COMPRESSION_POLICIES: Final[tuple[str, ...]] = get_args(CompressionPolicy)
#: zstd must shrink an int8 payload by this factor (a third fewer bytes) to be used: less
#: is not worth compressing and decompressing it, which cost twice its quantization.
MIN_ZSTD_GAIN: Final = 1.5
#: The gain each scheme's payload must show for ``auto`` to keep zstd.
_REQUIRED_GAIN: Final[dict[str, float]] = {"fp32": 1.0, "int4": 1.0, "int8": MIN_ZSTD_GAIN}
SAMPLE_WINDOW: Final = 8 << 10
SAMPLE_WINDOWS: Final = 4


def check_policy(policy: object) -> CompressionPolicy:
    if policy not in COMPRESSION_POLICIES:
        raise EncodeError(f"compression {policy!r} is not one of {', '.join(COMPRESSION_POLICIES)}")
    return policy  # type: ignore[return-value]


def check_zstd_threads(threads: object) -> int:
    if not isinstance(threads, int) or isinstance(threads, bool) or not 0 <= threads <= 256:
        raise EncodeError(f"zstd_threads {threads!r} must be an int from 0 to 256")
    return threads


def new_compressor(level: int, threads: int = 0) -> zstandard.ZstdCompressor:
    """A compressor whose frames declare their content size (not thread-safe).

    ``threads`` >= 1 selects zstd's multi-threaded mode, whose output does not depend on
    the number of threads (but differs from the single-threaded mode's, ``threads=0``).
    """
    return zstandard.ZstdCompressor(
        level=level, write_content_size=True, write_checksum=False, threads=threads
    )


def compress_payload(
    compressor: zstandard.ZstdCompressor,
    payload: memoryview,
    scheme: Scheme,
    policy: CompressionPolicy,
) -> tuple[Compression, Bytes]:
    """Return how ``payload`` (a byte view) goes on the wire: its compression and bytes."""
    size = payload.nbytes
    if policy == "none" or not size:
        return Compression.NONE, payload
    if policy == "zstd":
        return Compression.ZSTD, compressor.compress(payload)
    wanted = _REQUIRED_GAIN[scheme]
    small = size <= SAMPLE_WINDOW * SAMPLE_WINDOWS
    if wanted > 1.0 and not small and not _pays(compressor, _sample(payload)):
        return Compression.NONE, payload
    compressed = compressor.compress(payload)
    if size < wanted * len(compressed):
        return Compression.NONE, payload
    return Compression.ZSTD, compressed


def _sample(payload: memoryview) -> bytes:
    """:data:`SAMPLE_WINDOWS` windows centred at (i + 1/2) / n of the payload.

    The centres keep the sample clear of the block scales at the payload's start.
    """
    stride = payload.nbytes // SAMPLE_WINDOWS
    starts = [i * stride + (stride - SAMPLE_WINDOW) // 2 for i in range(SAMPLE_WINDOWS)]
    return b"".join(payload[start : start + SAMPLE_WINDOW] for start in starts)


def _pays(compressor: zstandard.ZstdCompressor, sample: bytes) -> bool:
    """Whether zstd gains :data:`MIN_ZSTD_GAIN` on ``sample``."""
    return len(sample) >= MIN_ZSTD_GAIN * len(compressor.compress(sample))


def decompress_exact(
    decompressor: zstandard.ZstdDecompressor, frame: Bytes, size: int, label: str
) -> bytes:
    """Decompress one zstd frame of exactly ``size`` bytes.

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
    return raw


class PayloadBuffer:
    """A reusable writable byte buffer that payloads are copied into for decoding."""

    def __init__(self) -> None:
        self._bytes = bytearray()
        self._tensor = torch.empty(0, dtype=torch.uint8)

    def fill(self, data: Bytes) -> torch.Tensor:
        """Copy ``data`` in; return a uint8 tensor over it, valid until the next fill."""
        view = memoryview(data).cast("B")
        size = view.nbytes
        if len(self._bytes) < size:
            self._bytes = bytearray(size)
            self._tensor = torch.frombuffer(self._bytes, dtype=torch.uint8)
        memoryview(self._bytes)[:size] = view
        return self._tensor[:size]
