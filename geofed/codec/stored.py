"""Decoding a stream stored whole in a file, its chunks side by side on several threads.

A stream that arrived and was verified whole (a delta the coordinator accepted) is
decoded again where its pieces are needed: :func:`decode_stored` finds its frames from
their prefixes (a header, chunks, a trailer that ends the file), checks the header and
the trailer, and hands each of ``workers`` threads a run of consecutive chunks to decode
with a decoder of its own (:meth:`~geofed.codec.decoder.StreamDecoder.from_chunk`), which
checks every chunk as a whole-stream decoder does: its tag, its place in the layout, the
header it belongs to, its sizes, its expected digest. The stream as a whole is checked
too: the trailer's chunk, element and byte counts and its digest chain over the chunks
(recomputed from the chunks' digests, in order, once every run is decoded); the file's own
sha256, hashed on one more thread meanwhile, is returned (a blob's name, to check or to
give). The pieces go to
``consume`` on the decoding threads, each element once, so a consumer writing each piece
where it belongs needs no lock. Which thread decodes which chunk does not change a bit of
any piece. Each thread holds one chunk's frame and values at a time. After the first error
every thread stops at its next chunk.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from geofed.codec.decoder import Piece, StreamDecoder
from geofed.codec.errors import CorruptStream, DigestMismatch, TruncatedStream
from geofed.codec.host_threads import one_thread
from geofed.codec.wire import (
    PREFIX,
    TAG_SIZE,
    TRAILER_FIELDS,
    FrameKind,
    TrailerFields,
    frame_size,
    parse_prefix,
    parse_trailer_body,
    verify_tag,
)

__all__ = ["decode_stored"]

#: Bytes read at a time to hash the file.
_READ_BYTES = 1 << 20


def decode_stored(
    path: str | os.PathLike[str],
    consume: Callable[[Piece], None],
    *,
    workers: int = 1,
    max_decoded_bytes: int | None = None,
    expected_digests: Sequence[str] | None = None,
    check_header: Callable[[StreamDecoder], None] | None = None,
) -> str:
    """Decode the stream stored at ``path``, each piece handed to ``consume`` on one of
    ``workers`` threads (see the module docstring); return the file's sha256 (hex), hashed
    on one more thread meanwhile. ``expected_digests``: the sha256 of every frame, header
    to trailer (a manifest's); ``check_header`` is called with a decoder that has read the
    header, before any chunk is decoded. Raises the codec's errors, and whatever
    ``consume`` or ``check_header`` raises, once every thread stopped; pieces handed over
    before an error must then be discarded."""
    with open(path, "rb", buffering=0) as file:
        fd = file.fileno()
        frames = _frames(fd, Path(path))
        if expected_digests is not None and len(expected_digests) != len(frames):
            raise CorruptStream(
                f"{path}: {len(frames)} frames, {len(expected_digests)} digests expected"
            )
        expected: dict[str, Any] = {}
        if expected_digests is not None:
            expected = {
                "expected_header_digest": expected_digests[0],
                "expected_digests": expected_digests[1:-1],
            }
        header = _read(fd, *frames[0])
        probe = StreamDecoder.from_chunk(
            header, 0, frames[0][1], max_decoded_bytes=max_decoded_bytes, **expected
        )
        if check_header is not None:
            check_header(probe)
        chunks = frames[1:-1]
        if probe.chunk_count != len(chunks):
            raise CorruptStream(
                f"{path}: {len(chunks)} chunk frames, the header's layout has {probe.chunk_count}"
            )
        trailer = _trailer(
            fd, frames[-1], probe, None if expected_digests is None else expected_digests[-1]
        )
        runs = _runs(len(chunks), max(1, min(workers, len(chunks))))
        stop = threading.Event()

        def decode_run(first: int, end: int) -> list[bytes]:
            decoder = StreamDecoder.from_chunk(
                header,
                first,
                chunks[first][0],
                max_decoded_bytes=max_decoded_bytes,
                **expected,
            )
            try:
                with one_thread():
                    for index in range(first, end):
                        if stop.is_set():
                            break
                        for piece in decoder.feed(_read(fd, *chunks[index])):
                            consume(piece)
            except BaseException:
                stop.set()
                raise
            return decoder.chunk_digests

        with ThreadPoolExecutor(len(runs) + 1, thread_name_prefix="geofed-decode") as pool:
            hashed = pool.submit(_file_sha256, fd)
            decoded = [pool.submit(decode_run, first, end) for first, end in runs]
        chain = hashlib.sha256(probe.header_digest)
        for future in decoded:
            for digest in future.result():  # the first error, in chunk order
                chain.update(digest)
        if chain.digest() != trailer.stream_digest:
            raise CorruptStream(f"{path}: the trailer's stream digest is not its chunks'")
        return hashed.result()


def _frames(fd: int, path: Path) -> list[tuple[int, int]]:
    """(offset, size) of every frame: a header, chunks, then a trailer ending the file."""
    end = os.fstat(fd).st_size
    frames: list[tuple[int, int]] = []
    kinds: list[FrameKind] = []
    offset = 0
    while offset < end:
        if kinds and kinds[-1] is FrameKind.TRAILER:
            raise CorruptStream(f"{path}: {end - offset} bytes of data after the stream trailer")
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


def _file_sha256(fd: int) -> str:
    hasher = hashlib.sha256()
    offset = 0
    while part := os.pread(fd, _READ_BYTES, offset):
        hasher.update(part)
        offset += len(part)
    return hasher.hexdigest()


def _trailer(
    fd: int, frame: tuple[int, int], header: StreamDecoder, expected: str | None
) -> TrailerFields:
    """The trailer's fields, checked against the header's layout and the frame's place."""
    offset, size = frame
    data = memoryview(_read(fd, offset, size))
    where = f"trailer at byte {offset}"
    prefix = parse_prefix(data, where)
    if prefix.version != header.wire_version:
        raise CorruptStream(
            f"{where}: wire-format version {prefix.version} in a version "
            f"{header.wire_version} stream"
        )
    if prefix.body_len != TRAILER_FIELDS.size:
        raise CorruptStream(
            f"{where}: trailer body of {prefix.body_len} bytes, not {TRAILER_FIELDS.size}"
        )
    digest = verify_tag(data, where).hex()
    if expected is not None and digest != expected:
        raise DigestMismatch(f"{where}: sha256 {digest} is not the expected {expected}")
    fields = parse_trailer_body(data[PREFIX.size : size - TAG_SIZE])
    found = (fields.chunk_count, fields.total_elements, fields.total_bytes)
    wanted = (header.chunk_count, sum(spec.numel for spec in header.specs), offset)
    if found != wanted:
        raise CorruptStream(f"{where}: (chunks, elements, bytes) is {found}, not {wanted}")
    return fields


def _runs(total: int, workers: int) -> list[tuple[int, int]]:
    """``total`` chunks cut into ``workers`` runs of consecutive chunks, as even as can be."""
    bounds = [total * k // workers for k in range(workers + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(workers) if bounds[k] < bounds[k + 1]]
