"""Rank 0's quantized delta as it lies in the hand-off directory: the sealed stream,
written once.

Rank 0 seals the codes and scales straight into ``round-<r>.delta.bin`` frame by frame
as it quantizes them, tensor by tensor (:class:`DeltaStreamWriter`, sealing in a thread
of its own), so the round's payloads are never all in memory; the round's result file
records the frames' sizes (:class:`WrittenDelta`). The agent reads the header to check
the delta against θ, hashes the frames for its manifest as it reads them, and gives the
file a second name in its spool (:meth:`regional_agent.state.JobDirectory.write_spool`):
the delta's bytes are written to disk once a round, by rank 0. Like every hand-off file
it is written to a temporary name and renamed, never rewritten in place, so a second
name always sees the bytes the manifest describes.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from geofed.codec import CodecError, QuantizedTensors, decode, write_quantized
from geofed.codec.encoder import frame_payloads
from geofed.codec.layout import ChunkSlot, chunk_slots
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


@dataclass(frozen=True)
class WrittenDelta:
    """A round's quantized delta sealed into its stream file as it was quantized: the
    frames' sizes, the sha256 of its payloads in order (:func:`payloads_digest`) and
    their bytes."""

    path: Path
    frames: tuple[int, ...]
    payloads_hash: str
    payload_bytes: int


#: Payloads waiting to be sealed: a few chunks, so the writer never holds the round's.
_QUEUED_PAYLOADS = 8
_END = object()


class DeltaStreamWriter:
    """A delta's stream file sealed as its payloads come, the same bytes as
    :func:`write_delta_stream` of the whole: :meth:`add` each tensor's payloads in the
    order of ``specs``, then :meth:`finish`; :meth:`abort` (or a failure) leaves the file
    at ``path`` as it was. The frames are sealed in a thread of the writer's own, fed
    through a short queue."""

    def __init__(
        self, path: Path, specs: Sequence[TensorLayout], codec: CodecParams, chunk_elements: int
    ) -> None:
        self.path = path
        self._slots = iter(chunk_slots(list(specs), chunk_elements))
        self._queue: queue.Queue[object] = queue.Queue(maxsize=_QUEUED_PAYLOADS)
        self._digest = hashlib.sha256()
        self._bytes = 0
        self._sizes: list[int] = []
        self._error: BaseException | None = None
        self._ended = False  # the sealing thread took the end of the payloads
        path.parent.mkdir(parents=True, exist_ok=True)
        self._atomic = AtomicFile(path, private=True)
        self._file = self._atomic.__enter__()
        self._thread = threading.Thread(
            target=self._seal,
            args=(list(specs), codec, chunk_elements),
            name=f"seal {path.name}",
            daemon=True,
        )
        self._thread.start()

    def _seal(self, specs: list[TensorLayout], codec: CodecParams, chunk_elements: int) -> None:
        def out(data: bytes) -> None:
            self._file.write(data)
            self._sizes.append(len(data))

        try:
            trailer = frame_payloads(
                specs,
                codec,
                chunk_elements,
                self._queued(),
                lambda sealed: out(sealed.data),
                lambda _slot, sealed: out(sealed.data),
                workers=1,
                compression="auto",
                zstd_threads=0,
            )
            out(trailer.data)
        except BaseException as exc:
            self._error = exc
            # Take what add() still puts until the end comes (the error is raised there),
            # unless the end came already (a failure sealing the trailer).
            while not self._ended and self._queue.get() is not _END:
                pass

    def _queued(self) -> Iterator[tuple[ChunkSlot, torch.Tensor]]:
        while (item := self._queue.get()) is not _END:
            yield item  # type: ignore[misc]
        self._ended = True

    def add(self, payloads: Sequence[torch.Tensor]) -> None:
        """Seal the next tensor's payloads (one per chunk, in order)."""
        for payload in payloads:
            slot = next(self._slots, None)
            if slot is None:
                raise InvalidHandoffData(f"{self.path}: more payloads than the stream's chunks")
            self._digest.update(payload.numpy().data)
            self._bytes += payload.nbytes
            self._queue.put((slot, payload))
        if self._error is not None:
            raise InvalidHandoffData(f"{self.path}: cannot seal the delta: {self._error}")

    def finish(self) -> WrittenDelta:
        """Seal the trailer and make the file durable at its path."""
        self._queue.put(_END)
        self._thread.join()
        if self._error is None and next(self._slots, None) is not None:
            self._error = InvalidHandoffData("fewer payloads than the stream's chunks")
        if self._error is not None:
            self._atomic.__exit__(type(self._error), self._error, None)
            raise InvalidHandoffData(f"{self.path}: cannot seal the delta: {self._error}")
        self._atomic.__exit__(None, None, None)
        return WrittenDelta(self.path, tuple(self._sizes), self._digest.hexdigest(), self._bytes)

    def abort(self) -> None:
        """Drop what was sealed: the file at the path stays as it was."""
        if self._thread.is_alive():
            self._error = self._error or InvalidHandoffData("aborted")
            self._queue.put(_END)
            self._thread.join()
        error = InvalidHandoffData("aborted")
        self._atomic.__exit__(type(error), error, None)


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
