"""Streaming, bounded, strict decoding of a framed stream into tensor pieces."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

import torch
import zstandard

from geofed.codec.compression import PayloadBuffer, decompress_exact
from geofed.codec.errors import (
    CorruptChunk,
    CorruptStream,
    DecodedSizeExceeded,
    DecoderStateError,
    DigestMismatch,
    InvalidConfig,
    OutOfOrder,
    TruncatedStream,
)
from geofed.codec.framing import FrameReader
from geofed.codec.layout import ChunkSlot, chunk_count, chunk_slots, payload_size
from geofed.codec.layout import zstd_compress_bound as compress_bound
from geofed.codec.quantize import BlockCodec
from geofed.codec.tensors import TensorLayout
from geofed.codec.wire import (
    CHUNK_FIELDS,
    MAX_HEADER_BODY,
    PREFIX,
    SCHEME_CODES,
    TRAILER_FIELDS,
    Bytes,
    ChunkFields,
    Compression,
    FrameKind,
    frame_size,
    parse_chunk_fields,
    parse_header_body,
    parse_prefix,
    parse_trailer_body,
    verify_tag,
)
from geofed.codec_params import CodecParams

_HEX_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_E = TypeVar("_E", bound=BaseException)


@dataclass(frozen=True, slots=True, eq=False)
class Piece:
    """Decoded values of ``name`` (flattened) from ``offset`` to ``offset + count``."""

    name: str
    offset: int
    count: int
    values: torch.Tensor  # 1-D float32 on the CPU


@dataclass(frozen=True, slots=True)
class _Header:
    """What the stream header established."""

    version: int  # the wire-format version of the header; every frame must share it
    codec: CodecParams
    chunk_elements: int
    specs: list[TensorLayout]
    block_codec: BlockCodec
    digest: bytes
    chunk_total: int
    chunk_limit: int  # the largest payload (stored or zstd) a chunk of this stream may carry


class _State(Enum):
    HEADER = "header"
    CHUNKS = "chunks"
    DONE = "done"


class StreamDecoder:
    """Decodes a stream fed in arbitrary pieces, yielding :class:`Piece` objects.

    Each frame is checked before anything of it is used: its sha256 tag, its place in
    the layout the header implies, the manifest digest when ``expected_digests`` (the
    chunks' sha256 hex digests in order) or ``expected_header_digest`` is given, and its
    declared sizes. ``max_decoded_bytes`` bounds the float32 size of everything the
    stream describes; a larger stream is refused at its header. After an error the
    decoder refuses further use, and the pieces it already yielded must be discarded.
    Iterate each iterator :meth:`feed` returns to its end before the next call.

    ``buffer_for(name, offset, count)``, if given, returns the 1-D float32 CPU tensor of
    ``count`` elements each chunk is decoded into (and that its piece's ``values`` is):
    a consumer that is done with a piece before the next one can reuse one buffer and
    spare fresh memory per chunk.
    """

    def __init__(
        self,
        *,
        expected_digests: Sequence[str] | None = None,
        expected_header_digest: str | None = None,
        max_decoded_bytes: int | None = None,
        buffer_for: Callable[[str, int, int], torch.Tensor] | None = None,
    ) -> None:
        self._expected = None if expected_digests is None else list(expected_digests)
        for digest in [*(self._expected or []), expected_header_digest]:
            if digest is not None and not (isinstance(digest, str) and _HEX_DIGEST.match(digest)):
                raise InvalidConfig(f"expected digest {digest!r} is not 64 lowercase hex digits")
        if max_decoded_bytes is not None and (
            not isinstance(max_decoded_bytes, int) or max_decoded_bytes < 0
        ):
            raise InvalidConfig(f"max_decoded_bytes {max_decoded_bytes!r} is not an int >= 0")
        self._expected_header = expected_header_digest
        self._max_decoded = max_decoded_bytes
        self._buffer_for = buffer_for
        self._frames = FrameReader()
        self._position = 0  # stream offset of the next frame
        self._state = _State.HEADER
        self._header: _Header | None = None
        self._slots: Iterator[ChunkSlot] = iter(())
        self._next: ChunkSlot | None = None
        self._stream_hash = hashlib.sha256()
        self._decompressor = zstandard.ZstdDecompressor()
        self._payload = PayloadBuffer()
        self._draining = False
        self._finished = False
        self._failure: BaseException | None = None
        #: The sha256 of each chunk frame decoded, in order (a decoder made by
        #: :meth:`from_chunk` decodes part of a stream: its caller chains them as the
        #: trailer's stream digest does).
        self.chunk_digests: list[bytes] = []

    @classmethod
    def from_chunk(
        cls,
        header: Bytes,
        index: int,
        position: int,
        *,
        max_decoded_bytes: int | None = None,
        expected_digests: Sequence[str] | None = None,
        expected_header_digest: str | None = None,
    ) -> StreamDecoder:
        """A decoder that has read the stream's ``header`` frame and takes its chunks from
        chunk ``index`` on, that chunk's frame starting at stream byte ``position``: each
        chunk is checked as a whole-stream decoder checks it (tag, place, header digest,
        sizes, and the digests expected, which name every chunk of the stream), but the
        trailer is not its to read. For decoding parts of a stored stream side by side
        (:mod:`geofed.codec.stored`)."""
        decoder = cls(
            max_decoded_bytes=max_decoded_bytes,
            expected_digests=expected_digests,
            expected_header_digest=expected_header_digest,
        )
        if list(decoder.feed(header)) or decoder._frames.buffered or decoder._header is None:
            raise InvalidConfig("from_chunk takes a stream's header frame, and that alone")
        known = decoder._known_header()
        if not 0 <= index <= known.chunk_total:
            raise InvalidConfig(f"chunk {index} of a stream of {known.chunk_total} chunks")
        slots = chunk_slots(known.specs, known.chunk_elements)
        for _ in range(index):
            next(slots)
        decoder._slots = slots
        decoder._next = next(slots, None)
        decoder._position = position
        return decoder

    @property
    def specs(self) -> list[TensorLayout]:
        """The tensors the stream describes; available once the header was read."""
        return list(self._known_header().specs)

    @property
    def codec(self) -> CodecParams:
        """The codec parameters the stream header names; available once it was read."""
        return self._known_header().codec

    @property
    def header_digest(self) -> bytes:
        """The sha256 of the stream's header frame; available once it was read."""
        return self._known_header().digest

    @property
    def wire_version(self) -> int:
        """The stream's wire-format version; available once its header was read."""
        return self._known_header().version

    @property
    def chunk_count(self) -> int:
        """Chunks the stream's layout has, from the stream header."""
        return self._known_header().chunk_total

    @property
    def chunk_elements(self) -> int:
        """Elements per chunk, from the stream header."""
        return self._known_header().chunk_elements

    @property
    def complete(self) -> bool:
        """Whether the trailer was read and checked."""
        return self._state is _State.DONE

    def feed(self, data: Bytes) -> Generator[Piece, None, None]:
        """Take the next bytes of the stream; iterate the result for the pieces they complete."""
        self._check_usable("feed()")
        self._frames.push(data)
        self._draining = True
        return self._drain()

    def finish(self) -> None:
        """Declare the end of the stream; raise :class:`TruncatedStream` if it is incomplete."""
        self._check_usable("finish()")
        self._finished = True
        if self._state is _State.DONE:
            return
        if self._state is _State.HEADER:
            raise self._fail(
                TruncatedStream(f"stream ended before its header ({self._frames.buffered} bytes)")
            )
        total = self._known_header().chunk_total
        where = f"after {total - self._remaining()} of {total} chunks"
        if self._frames.buffered:
            raise self._fail(
                TruncatedStream(
                    f"stream ended {where}, inside a frame ({self._frames.buffered} bytes)"
                )
            )
        raise self._fail(TruncatedStream(f"stream ended {where}, without its trailer"))

    # -- framing --------------------------------------------------------------------

    def _known_header(self) -> _Header:
        if self._header is None:
            raise DecoderStateError("the stream header has not been read yet")
        return self._header

    def _check_usable(self, call: str) -> None:
        if self._failure is not None:
            raise DecoderStateError(f"{call} on a decoder that failed: {self._failure}")
        if self._finished:
            raise DecoderStateError(f"{call} after finish()")
        if self._draining:
            raise DecoderStateError(f"{call} before the previous feed() iterator was exhausted")

    def _drain(self) -> Generator[Piece, None, None]:
        try:
            while True:
                frame = self._next_frame()
                if frame is None:
                    break
                piece = self._process(frame)
                self._frames.done_with(frame)
                if piece is not None:
                    yield piece
        except GeneratorExit:
            self._fail(DecoderStateError("a feed() iterator was closed early; pieces were lost"))
            raise
        except BaseException as exc:
            self._fail(exc)
            raise
        self._frames.keep_rest()
        self._draining = False

    def _next_frame(self) -> memoryview | None:
        if self._state is _State.DONE and self._frames.buffered:
            raise CorruptStream(f"{self._frames.buffered} bytes of data after the stream trailer")
        return self._frames.next_frame(self._frame_size)

    def _frame_size(self, data: Bytes) -> int:
        """Check a frame prefix against the stream state; return the frame's full size."""
        where = f"frame at stream byte {self._position}"
        prefix = parse_prefix(data, where)
        kind, body_len = prefix.kind, prefix.body_len
        if self._header is not None and prefix.version != self._header.version:
            raise CorruptStream(
                f"{where}: wire-format version {prefix.version} in a version "
                f"{self._header.version} stream"
            )
        if self._state is _State.HEADER:
            if kind is not FrameKind.HEADER:
                raise CorruptStream(f"{where}: stream starts with a {kind.name} frame, not HEADER")
            if body_len > MAX_HEADER_BODY:
                raise CorruptStream(
                    f"{where}: header body of {body_len} bytes exceeds {MAX_HEADER_BODY}"
                )
        elif kind is FrameKind.HEADER:
            raise CorruptStream(f"{where}: a second stream header")
        elif kind is FrameKind.TRAILER and body_len != TRAILER_FIELDS.size:
            raise CorruptStream(
                f"{where}: trailer body of {body_len} bytes, not {TRAILER_FIELDS.size}"
            )
        elif kind is FrameKind.CHUNK:
            limit = CHUNK_FIELDS.size + self._known_header().chunk_limit
            if not CHUNK_FIELDS.size < body_len <= limit:
                raise CorruptChunk(
                    f"{where}: chunk body of {body_len} bytes; chunks of this stream hold "
                    f"{CHUNK_FIELDS.size + 1} to {limit}"
                )
        return frame_size(body_len)

    def _process(self, frame: memoryview) -> Piece | None:
        where = f"frame at stream byte {self._position}"
        digest = verify_tag(frame, where)
        prefix = parse_prefix(frame, where)
        kind = prefix.kind
        body = frame[PREFIX.size : -len(digest)]
        piece = None
        if kind is FrameKind.HEADER:
            self._read_header(body, digest, prefix.version)
        elif kind is FrameKind.CHUNK:
            piece = self._read_chunk(body, digest)
        else:
            self._read_trailer(body)
        self._position += len(frame)
        return piece

    # -- frames ---------------------------------------------------------------------

    def _read_header(self, body: memoryview, digest: bytes, version: int) -> None:
        if self._expected_header is not None and digest.hex() != self._expected_header:
            raise DigestMismatch(
                f"stream header sha256 {digest.hex()} is not the manifest's {self._expected_header}"
            )
        codec, chunk_elements, specs = parse_header_body(body, "stream header")
        total = chunk_count(specs, chunk_elements)
        if self._expected is not None and len(self._expected) != total:
            raise CorruptStream(
                f"stream has {total} chunks but the manifest lists {len(self._expected)} digests"
            )
        size = 4 * sum(spec.numel for spec in specs)
        if self._max_decoded is not None and size > self._max_decoded:
            raise DecodedSizeExceeded(
                f"stream describes {size} bytes of float32 tensors, more than the "
                f"{self._max_decoded} this decoder accepts"
            )
        self._header = _Header(
            version=version,
            codec=codec,
            chunk_elements=chunk_elements,
            specs=specs,
            block_codec=BlockCodec(codec.scheme, codec.block_size),
            digest=digest,
            chunk_total=total,
            chunk_limit=compress_bound(
                payload_size(codec.scheme, chunk_elements, codec.block_size)
            ),
        )
        self._slots = chunk_slots(specs, chunk_elements)
        self._next = next(self._slots, None)
        self._stream_hash = hashlib.sha256(digest)
        self._state = _State.CHUNKS

    def _read_chunk(self, body: memoryview, digest: bytes) -> Piece:
        header = self._known_header()
        fields = parse_chunk_fields(body)
        slot = self._next
        if slot is None:
            raise OutOfOrder(
                f"chunk {fields.index} arrived after the last of {header.chunk_total} chunks"
            )
        if fields.index != slot.index:
            raise OutOfOrder(f"chunk {fields.index} arrived where chunk {slot.index} was expected")
        if fields.header_digest != header.digest:
            raise CorruptChunk(f"chunk {slot.index} belongs to another stream (header digest)")
        if self._expected is not None and digest.hex() != self._expected[slot.index]:
            raise DigestMismatch(
                f"chunk {slot.index} sha256 {digest.hex()} is not the manifest's "
                f"{self._expected[slot.index]}"
            )
        spec = header.specs[slot.tensor]
        stop = slot.offset + slot.count
        label = f"chunk {slot.index} (tensor {spec.name!r} elements [{slot.offset}:{stop}])"
        found = (fields.tensor, fields.offset, fields.count, fields.scheme_code)
        wanted = (slot.tensor, slot.offset, slot.count, SCHEME_CODES[header.codec.scheme])
        if found != wanted:
            raise CorruptChunk(f"{label}: (tensor, offset, count, scheme) is {found}, not {wanted}")
        size = payload_size(header.codec.scheme, slot.count, header.codec.block_size)
        if fields.decoded_size != size:
            error = DecodedSizeExceeded if fields.decoded_size > size else CorruptChunk
            raise error(f"{label}: declares {fields.decoded_size} decoded bytes, not {size}")
        out = self._output_buffer(spec.name, slot)
        if out is None:
            # The payload buffer is reused: values must not be a view of it.
            out = torch.empty(slot.count, dtype=torch.float32)
        payload = self._payload.fill(self._payload_bytes(fields, body, size, label))
        values = header.block_codec.decode(payload, slot.count, label=label, out=out)
        self._stream_hash.update(digest)
        self.chunk_digests.append(digest)
        self._next = next(self._slots, None)
        return Piece(spec.name, slot.offset, slot.count, values)

    def _payload_bytes(self, fields: ChunkFields, body: memoryview, size: int, label: str) -> Bytes:
        """The chunk's decoded payload, exactly ``size`` bytes, as its compression stores it."""
        data = body[CHUNK_FIELDS.size :]
        version = self._known_header().version
        known = (Compression.ZSTD,) if version == 1 else tuple(Compression)
        if fields.compression not in known or fields.reserved:
            raise CorruptChunk(
                f"{label}: compression code {fields.compression} and reserved field "
                f"{fields.reserved} are not valid in a version {version} stream"
            )
        if fields.compression == Compression.NONE:
            if len(data) != size:
                raise CorruptChunk(f"{label}: stored payload of {len(data)} bytes, not {size}")
            return data
        return decompress_exact(self._decompressor, data, size, label)

    def _output_buffer(self, name: str, slot: ChunkSlot) -> torch.Tensor | None:
        if self._buffer_for is None:
            return None
        out = self._buffer_for(name, slot.offset, slot.count)
        if not (
            isinstance(out, torch.Tensor)
            and out.dtype == torch.float32
            and out.device.type == "cpu"
            and out.shape == (slot.count,)
            and out.is_contiguous()
        ):
            raise InvalidConfig(
                f"buffer_for({name!r}, {slot.offset}, {slot.count}) must return a contiguous "
                f"1-D float32 CPU tensor of {slot.count} elements"
            )
        return out

    def _read_trailer(self, body: memoryview) -> None:
        header = self._known_header()
        fields = parse_trailer_body(body)
        remaining = self._remaining()
        if remaining:
            raise TruncatedStream(
                f"trailer arrived after {header.chunk_total - remaining} of "
                f"{header.chunk_total} chunks"
            )
        found = (fields.chunk_count, fields.total_elements, fields.total_bytes)
        wanted = (header.chunk_total, sum(spec.numel for spec in header.specs), self._position)
        if found != wanted:
            raise CorruptStream(f"trailer (chunks, elements, bytes) is {found}, not {wanted}")
        if fields.stream_digest != self._stream_hash.digest():
            raise CorruptStream("trailer stream digest does not match the chunks received")
        self._state = _State.DONE

    def _remaining(self) -> int:
        if self._next is None or self._header is None:
            return 0
        return self._header.chunk_total - self._next.index

    def _fail(self, error: _E) -> _E:
        self._failure = error
        self._draining = False
        return error
