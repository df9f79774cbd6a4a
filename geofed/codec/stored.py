"""Decoding a stream stored whole in a file, its chunks side by side on several threads.

A stream that arrived and was verified whole (a delta the coordinator accepted) is
decoded again where its pieces are needed: :func:`decode_stored` finds its frames from
their prefixes, checks the header and the trailer's counts, and hands each of ``workers``
threads a run of consecutive chunks to decode with a decoder of its own
(:meth:`~geofed.codec.decoder.StreamDecoder.from_chunk`), which checks every chunk as a
whole-stream decoder does: its tag, its place in the layout, the header it belongs to, its
sizes. The pieces go to ``consume`` on those threads, each element once, so a consumer
writing each piece where it belongs needs no lock. Which thread decodes which chunk does
not change a bit of any piece. The trailer's digest chain over the chunks is not
recomputed (each chunk's own tag and index stand for it); its chunk, element and byte
counts are checked.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from geofed.codec.decoder import Piece, StreamDecoder
from geofed.codec.errors import CorruptStream, TruncatedStream
from geofed.codec.host_threads import one_thread
from geofed.codec.wire import (
    PREFIX,
    TAG_SIZE,
    FrameKind,
    frame_size,
    parse_prefix,
    parse_trailer_body,
    verify_tag,
)

__all__ = ["decode_stored"]


def decode_stored(
    path: str | os.PathLike[str],
    consume: Callable[[Piece], None],
    *,
    workers: int = 1,
    max_decoded_bytes: int | None = None,
) -> None:
    """Decode the stream stored at ``path``, each piece handed to ``consume`` on one of
    ``workers`` threads (see the module docstring). Raises the codec's errors, and
    whatever ``consume`` raises, once every thread stopped; pieces handed over before
    an error must then be discarded."""
    with open(path, "rb", buffering=0) as file:
        fd = file.fileno()
        frames = _frames(fd, Path(path))
        header = _read(fd, *frames[0])
        probe = StreamDecoder.from_chunk(
            header, 0, frames[0][1], max_decoded_bytes=max_decoded_bytes
        )
        chunks = frames[1:-1]
        total = len(chunks)
        if probe.chunk_count != total:
            raise CorruptStream(
                f"{path}: {total} chunk frames, the header's layout has {probe.chunk_count}"
            )
        _check_trailer(fd, frames[-1], total, sum(spec.numel for spec in probe.specs))
        runs = _runs(total, max(1, min(workers, total)))
        if not runs:
            return  # only empty tensors: nothing to decode

        def decode_run(first: int, stop: int) -> None:
            offset = chunks[first][0] if first < total else frames[-1][0]
            decoder = StreamDecoder.from_chunk(
                header, first, offset, max_decoded_bytes=max_decoded_bytes
            )
            with one_thread():
                for index in range(first, stop):
                    for piece in decoder.feed(_read(fd, *chunks[index])):
                        consume(piece)

        if len(runs) == 1:
            decode_run(*runs[0])
            return
        with ThreadPoolExecutor(len(runs), thread_name_prefix="geofed-decode") as pool:
            futures = [pool.submit(decode_run, first, stop) for first, stop in runs]
        for future in futures:
            future.result()  # the first error, in chunk order


def _frames(fd: int, path: Path) -> list[tuple[int, int]]:
    """(offset, size) of every frame: a header, chunks, then a trailer ending the file."""
    end = os.fstat(fd).st_size
    frames: list[tuple[int, int]] = []
    kinds: list[FrameKind] = []
    offset = 0
    while offset < end:
        where = f"{path}: frame at byte {offset}"
        prefix_bytes = os.pread(fd, PREFIX.size, offset)
        if len(prefix_bytes) < PREFIX.size:
            raise TruncatedStream(f"{where}: ends inside a frame prefix")
        prefix = parse_prefix(prefix_bytes, where)
        size = frame_size(prefix.body_len)
        if offset + size > end:
            raise TruncatedStream(f"{where}: ends inside a frame of {size} bytes")
        frames.append((offset, size))
        kinds.append(prefix.kind)
        offset += size
    if not kinds or kinds[0] is not FrameKind.HEADER:
        raise CorruptStream(f"{path}: does not start with a stream header")
    if len(kinds) < 2 or kinds[-1] is not FrameKind.TRAILER:
        raise TruncatedStream(f"{path}: does not end with a stream trailer")
    if any(kind is not FrameKind.CHUNK for kind in kinds[1:-1]):
        raise CorruptStream(f"{path}: a frame between the header and the trailer is no chunk")
    return frames


def _read(fd: int, offset: int, size: int) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise TruncatedStream(f"frame at byte {offset}: {len(data)} of its {size} bytes")
    return data


def _check_trailer(fd: int, frame: tuple[int, int], chunks: int, elements: int) -> None:
    offset, size = frame
    data = memoryview(_read(fd, offset, size))
    where = f"trailer at byte {offset}"
    verify_tag(data, where)
    fields = parse_trailer_body(data[PREFIX.size : size - TAG_SIZE])
    found = (fields.chunk_count, fields.total_elements, fields.total_bytes)
    if found != (chunks, elements, offset):
        raise CorruptStream(
            f"{where}: (chunks, elements, bytes) is {found}, not {(chunks, elements, offset)}"
        )


def _runs(total: int, workers: int) -> list[tuple[int, int]]:
    """``total`` chunks cut into ``workers`` runs of consecutive chunks, as even as can be."""
    bounds = [total * k // workers for k in range(workers + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(workers) if bounds[k] < bounds[k + 1]]
