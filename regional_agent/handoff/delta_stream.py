"""Rank 0's quantized delta as it lies in the hand-off directory: the sealed stream,
written once.

Rank 0 seals the codes and scales it quantized (:func:`geofed.codec.write_quantized`)
straight into ``round-<r>.delta.bin``, frame by frame; the round's result file records
the frames' sizes. The agent reads the header to check the delta against θ, hashes the
frames for its manifest as it reads them, and gives the file a second name in its spool
(:meth:`regional_agent.state.JobDirectory.write_spool`): the delta's bytes are written
to disk once a round, by rank 0. Like every hand-off file it is written to a temporary
name and renamed, never rewritten in place, so a second name always sees the bytes the
manifest describes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from geofed.codec import CodecError, QuantizedTensors, decode, write_quantized
from geofed.codec.tensors import TensorLayout
from geofed.codec.wire import (
    PREFIX,
    FrameKind,
    frame_size,
    parse_header_body,
    parse_prefix,
    verify_tag,
)
from geofed.codec_params import CodecParams
from geofed.fsutil import AtomicFile
from regional_agent.handoff.errors import InvalidHandoffData


@dataclass(frozen=True)
class DeltaStream:
    """A sealed delta stream in a file: its frames' sizes and what its header says."""

    path: Path
    frame_sizes: tuple[int, ...]
    codec: CodecParams
    chunk_elements: int
    specs: list[TensorLayout]

    @property
    def names(self) -> list[str]:
        """The tensors the delta holds, in stream order."""
        return [spec.name for spec in self.specs]

    def frames(self) -> Iterator[bytes]:
        """The stream's frames in order, read one at a time (blocking)."""
        with self.path.open("rb") as f:
            for index, size in enumerate(self.frame_sizes):
                frame = f.read(size)
                if len(frame) != size:
                    raise InvalidHandoffData(f"{self.path}: truncated at frame {index}")
                yield frame

    def to_bytes(self) -> bytes:
        return b"".join(self.frames())

    def decode(self) -> dict[str, torch.Tensor]:
        """The float32 values a decoder of this stream gets (what the coordinator will)."""
        try:
            return decode(self.frames())
        except CodecError as exc:
            raise InvalidHandoffData(f"{self.path}: {exc}") from None


def write_delta_stream(path: Path, quantized: QuantizedTensors) -> tuple[int, ...]:
    """Seal ``quantized`` into ``path`` (temp + fsync + rename, readable by its owner only,
    as the agent's spool is); return the frames' sizes."""
    with AtomicFile(path, private=True) as f:
        return tuple(write_quantized(quantized, f.write))


def open_delta_stream(path: Path, frame_sizes: Sequence[object]) -> DeltaStream:
    """The delta stream at ``path`` of frames of ``frame_sizes``, its header read and
    checked; :class:`InvalidHandoffData` when the file or the sizes do not fit."""
    if len(frame_sizes) < 2 or not all(
        isinstance(size, int) and not isinstance(size, bool) and size >= frame_size(0)
        for size in frame_sizes
    ):
        raise InvalidHandoffData(f"{path}: frame sizes {list(frame_sizes)[:4]}... are not valid")
    sizes = tuple(int(size) for size in frame_sizes)  # type: ignore[call-overload]
    try:
        length = path.stat().st_size
        with path.open("rb") as f:
            header = memoryview(f.read(sizes[0]))
    except FileNotFoundError:
        raise InvalidHandoffData(f"{path}: the delta's stream file is missing") from None
    if length != sum(sizes):
        raise InvalidHandoffData(f"{path}: {length} bytes, its frames add up to {sum(sizes)}")
    try:
        prefix = parse_prefix(header, f"{path}: header")
        if prefix.kind is not FrameKind.HEADER or frame_size(prefix.body_len) != sizes[0]:
            raise InvalidHandoffData(f"{path}: the first frame is not the stream's header")
        verify_tag(header, f"{path}: header")
        body = header[PREFIX.size : PREFIX.size + prefix.body_len]
        codec, chunk_elements, specs = parse_header_body(body, f"{path}: header")
    except CodecError as exc:
        raise InvalidHandoffData(str(exc)) from None
    return DeltaStream(path, sizes, codec, chunk_elements, specs)
