"""Where each chunk of a stream lies, and how many bytes its payload holds.

The layout is a pure function of the tensors, the codec parameters and the chunk size
(``chunk_elements``, recorded in the stream header), so the decoder knows exactly which
chunk must come next and how large it may be before it reads a byte of it. The chunk
size is the encoder's choice, not a parameter of the job: any multiple of the block size
decodes alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final

from geofed.codec.tensors import TensorLayout
from geofed.codec_params import InvalidConfig, Scheme, check_int

SCALE_BYTES: Final = 2  # bfloat16 scales
DEFAULT_CHUNK_ELEMENTS: Final = 1 << 20
MAX_CHUNK_ELEMENTS: Final = 1 << 28


@dataclass(frozen=True, slots=True)
class ChunkSlot:
    """The place of one chunk: its sequence number and the tensor slice it carries."""

    index: int
    tensor: int
    offset: int
    count: int


def check_chunk_elements(chunk_elements: object, block_size: int) -> int:
    """Return ``chunk_elements`` if it is a usable chunk size for ``block_size``, else raise.

    Blocks start at the beginning of each chunk, so a chunk holds whole blocks.
    """
    count = check_int("chunk_elements", chunk_elements, block_size, MAX_CHUNK_ELEMENTS)
    if count % block_size:
        nearest = max(block_size, count // block_size * block_size)
        raise InvalidConfig(
            f"chunk_elements {count} is not a multiple of block_size {block_size}; "
            f"use e.g. {nearest}"
        )
    return count


def num_blocks(count: int, block_size: int) -> int:
    return -(-count // block_size)


def payload_size(scheme: Scheme, count: int, block_size: int) -> int:
    """Bytes of a chunk's decoded (decompressed) payload."""
    if scheme == "fp32":
        return 4 * count
    scales = SCALE_BYTES * num_blocks(count, block_size)
    if scheme == "int8":
        return scales + count
    return scales + (count + 1) // 2


def chunk_slots(specs: Sequence[TensorLayout], chunk_elements: int) -> Iterator[ChunkSlot]:
    """Yield every chunk of a stream in order; empty tensors have no chunk."""
    index = 0
    for tensor, spec in enumerate(specs):
        numel = spec.numel
        for offset in range(0, numel, chunk_elements):
            yield ChunkSlot(index, tensor, offset, min(chunk_elements, numel - offset))
            index += 1


def chunk_count(specs: Sequence[TensorLayout], chunk_elements: int) -> int:
    return sum(-(-spec.numel // chunk_elements) for spec in specs)


def zstd_compress_bound(size: int) -> int:
    """ZSTD_COMPRESSBOUND: the largest frame zstd emits for ``size`` input bytes."""
    small = ((128 << 10) - size) >> 11 if size < (128 << 10) else 0
    return size + (size >> 8) + small
