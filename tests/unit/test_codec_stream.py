"""Framing: self-description, manifests, arbitrary feed boundaries, and refusal of
truncated, corrupted, reordered, spliced and oversized streams."""

from __future__ import annotations

import hashlib
import itertools
import resource
import struct

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geofed.codec import (
    CorruptChunk,
    CorruptStream,
    DecodedSizeExceeded,
    DecodeError,
    DecoderStateError,
    DigestMismatch,
    EncodedStream,
    InvalidConfig,
    OutOfOrder,
    StreamDecoder,
    TruncatedStream,
    UnsupportedVersion,
    decode,
    decode_pieces,
    encode_stream,
)
from geofed.codec.layout import payload_size
from geofed.codec.wire import (
    CHUNK_FIELDS,
    PREFIX,
    SCHEME_CODES,
    VERSION,
    ChunkFields,
    FrameKind,
    chunk_fields,
    seal,
)
from geofed.codec_params import CodecParams, Scheme

PROPERTY = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_stream(scheme: Scheme = "int8", seed: int = 0, scale: float = 1.0) -> EncodedStream:
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        "layer.weight": torch.randn(20, 16, generator=generator) * scale,
        "layer.bias": torch.randn(5, generator=generator).half() * scale,
        "empty": torch.empty(0),
    }
    return encode_stream(tensors, CodecParams(scheme=scheme, block_size=16), chunk_elements=128)


STREAM = make_stream()
DATA = STREAM.to_bytes()


def decode_all(data: bytes, **kwargs: object) -> dict[str, torch.Tensor]:
    return decode(data, **kwargs)  # type: ignore[arg-type]


def test_the_stream_is_header_chunks_trailer() -> None:
    assert [chunk.count for chunk in STREAM.chunks] == [128, 128, 64, 5]
    assert b"".join([STREAM.header, *(c.data for c in STREAM.chunks), STREAM.trailer]) == DATA
    assert STREAM.total_bytes == len(DATA)
    assert DATA[:4] == b"GFDC"
    assert STREAM.header_digest == hashlib.sha256(STREAM.header).hexdigest()
    for chunk in STREAM.chunks:
        assert chunk.digest == hashlib.sha256(chunk.data).hexdigest()
    assert STREAM.digests == [chunk.digest for chunk in STREAM.chunks]


def test_frames_sent_separately_decode_with_the_manifest() -> None:
    decoded = decode(
        STREAM.frames(),
        expected_digests=STREAM.digests,
        expected_header_digest=STREAM.header_digest,
    )
    assert set(decoded) == {"layer.weight", "layer.bias", "empty"}


def test_decoder_exposes_the_header_once_read() -> None:
    decoder = StreamDecoder()
    with pytest.raises(DecoderStateError, match="header has not been read"):
        _ = decoder.specs
    assert list(decoder.feed(STREAM.header)) == []
    assert [spec.name for spec in decoder.specs] == ["layer.weight", "layer.bias", "empty"]
    assert decoder.specs[1].dtype == "float16"
    assert decoder.codec == STREAM.codec
    assert decoder.chunk_elements == STREAM.chunk_elements
    assert not decoder.complete


@PROPERTY
@given(st.lists(st.integers(0, len(DATA)), max_size=12))
def test_any_feed_boundaries_give_the_same_pieces(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(DATA)]
    parts = [DATA[a:b] for a, b in itertools.pairwise(bounds)]
    reference = list(decode_pieces(DATA))
    pieces = list(decode_pieces(parts, expected_digests=STREAM.digests))
    assert [(p.name, p.offset, p.count) for p in pieces] == [
        (p.name, p.offset, p.count) for p in reference
    ]
    for piece, expected in zip(pieces, reference, strict=True):
        assert torch.equal(piece.values, expected.values)


def test_byte_by_byte_feeding_decodes() -> None:
    decoder = StreamDecoder(expected_digests=STREAM.digests)
    pieces = [piece for i in range(len(DATA)) for piece in decoder.feed(DATA[i : i + 1])]
    decoder.finish()
    assert decoder.complete
    assert sum(piece.count for piece in pieces) == 20 * 16 + 5


def test_every_truncation_is_refused() -> None:
    for cut in range(len(DATA)):
        with pytest.raises(TruncatedStream):
            decode_all(DATA[:cut])


def test_truncation_messages_say_where() -> None:
    with pytest.raises(TruncatedStream, match="before its header"):
        decode_all(DATA[:10])
    end_of_chunk_1 = len(STREAM.header) + len(STREAM.chunks[0].data) + len(STREAM.chunks[1].data)
    with pytest.raises(TruncatedStream, match="after 2 of 4 chunks, without its trailer"):
        decode_all(DATA[:end_of_chunk_1])
    with pytest.raises(TruncatedStream, match="after 2 of 4 chunks, inside a frame"):
        decode_all(DATA[: end_of_chunk_1 + 30])
    without_last = STREAM.header + b"".join(c.data for c in STREAM.chunks[:3]) + STREAM.trailer
    with pytest.raises(TruncatedStream, match="trailer arrived after 3 of 4 chunks"):
        decode_all(without_last)


def flip(data: bytes, position: int, mask: int = 0xFF) -> bytes:
    return data[:position] + bytes([data[position] ^ mask]) + data[position + 1 :]


@pytest.mark.parametrize("scheme", ["fp32", "int4"])
def test_every_flipped_byte_is_detected(scheme: Scheme) -> None:
    stream = make_stream(scheme)
    data = stream.to_bytes()
    for position in range(len(data)):
        with pytest.raises(DecodeError):
            decode_all(flip(data, position))


@PROPERTY
@given(st.integers(0, len(DATA) - 1), st.integers(1, 255), st.booleans())
def test_any_flipped_bits_are_detected(position: int, mask: int, manifest: bool) -> None:
    digests = STREAM.digests if manifest else None
    with pytest.raises(DecodeError):
        decode_all(flip(DATA, position, mask), expected_digests=digests)


def test_a_flipped_payload_byte_is_reported_as_a_bad_tag() -> None:
    position = len(STREAM.header) + PREFIX.size + CHUNK_FIELDS.size + 5
    with pytest.raises(CorruptStream, match=r"frame at stream byte \d+: sha256 tag does not match"):
        decode_all(flip(DATA, position))


def test_unknown_magic_and_version_are_refused() -> None:
    with pytest.raises(UnsupportedVersion, match="magic b'XFDC' is not b'GFDC'"):
        decode_all(b"X" + DATA[1:])
    for version in (0, 3, 255):
        with pytest.raises(
            UnsupportedVersion, match=f"wire-format version {version} \\(this decoder reads 1, 2\\)"
        ):
            decode_all(DATA[:4] + bytes([version]) + DATA[5:])


def frames_in_order(stream: EncodedStream, order: list[int]) -> bytes:
    return stream.header + b"".join(stream.chunks[i].data for i in order) + stream.trailer


def test_reordered_chunks_are_refused() -> None:
    with pytest.raises(OutOfOrder, match="chunk 2 arrived where chunk 1 was expected"):
        decode_all(frames_in_order(STREAM, [0, 2, 1, 3]))


def test_duplicated_chunks_are_refused() -> None:
    with pytest.raises(OutOfOrder, match="chunk 0 arrived where chunk 1 was expected"):
        decode_all(frames_in_order(STREAM, [0, 0, 1, 2, 3]))
    with pytest.raises(OutOfOrder, match="chunk 3 arrived after the last of 4 chunks"):
        decode_all(frames_in_order(STREAM, [0, 1, 2, 3, 3]))


def test_a_chunk_of_a_stream_with_another_header_is_refused() -> None:
    other = encode_stream(
        {"layer.weight": torch.zeros(20, 16), "layer.bias": torch.zeros(5).half()},
        CodecParams(scheme="int8", block_size=16),
        chunk_elements=128,
    )
    spliced = STREAM.header + other.chunks[0].data
    with pytest.raises(CorruptChunk, match="chunk 0 belongs to another stream"):
        decode_all(spliced)


def test_a_chunk_spliced_from_a_same_shaped_stream_is_caught() -> None:
    other = make_stream(seed=1)
    assert other.header == STREAM.header
    chunks = [STREAM.chunks[0], other.chunks[1], *STREAM.chunks[2:]]
    spliced = STREAM.header + b"".join(c.data for c in chunks) + STREAM.trailer
    with pytest.raises(CorruptStream, match="trailer stream digest does not match"):
        decode_all(spliced)
    with pytest.raises(DigestMismatch, match=r"chunk 1 sha256 [0-9a-f]{64} is not the manifest's"):
        decode_all(spliced, expected_digests=STREAM.digests)


def test_manifest_mismatches_are_refused() -> None:
    with pytest.raises(CorruptStream, match="stream has 4 chunks but the manifest lists 3"):
        decode_all(DATA, expected_digests=STREAM.digests[:3])
    with pytest.raises(DigestMismatch, match="stream header sha256"):
        decode_all(DATA, expected_header_digest="0" * 64)
    with pytest.raises(InvalidConfig, match="is not 64 lowercase hex digits"):
        StreamDecoder(expected_digests=["ABC"])


@pytest.mark.parametrize("extra", [b"\x00", STREAM.header])
def test_data_after_the_trailer_is_refused(extra: bytes) -> None:
    with pytest.raises(CorruptStream, match=f"{len(extra)} bytes of data after the stream trailer"):
        decode_all(DATA + extra)
    decoder = StreamDecoder()
    list(decoder.feed(DATA))
    assert decoder.complete
    with pytest.raises(CorruptStream, match="after the stream trailer"):
        list(decoder.feed(extra))


def test_a_stream_must_start_with_its_header() -> None:
    with pytest.raises(CorruptStream, match="stream starts with a CHUNK frame, not HEADER"):
        decode_all(STREAM.chunks[0].data)
    with pytest.raises(CorruptStream, match="a second stream header"):
        decode_all(STREAM.header + STREAM.header)


def test_max_decoded_bytes_refuses_large_streams_at_the_header() -> None:
    fp32_size = 4 * (20 * 16 + 5)
    assert decode_all(DATA, max_decoded_bytes=fp32_size)
    decoder = StreamDecoder(max_decoded_bytes=fp32_size - 1)
    with pytest.raises(DecodedSizeExceeded, match=f"describes {fp32_size} bytes"):
        list(decoder.feed(STREAM.header))


# -- decompression bombs: frames whose hashes are valid but whose sizes lie ---------


def forged_chunk(stream: EncodedStream, *, decoded_size: int | None = None, zframe: bytes) -> bytes:
    """A chunk 0 frame with a valid tag carrying ``zframe``, as a hostile sender would."""
    slot = stream.chunks[0]
    size = payload_size(stream.codec.scheme, slot.count, stream.codec.block_size)
    fields = ChunkFields(
        index=0,
        tensor=0,
        scheme_code=SCHEME_CODES[stream.codec.scheme],
        offset=0,
        count=slot.count,
        decoded_size=size if decoded_size is None else decoded_size,
        header_digest=bytes.fromhex(stream.header_digest),
    )
    return seal(FrameKind.CHUNK, [chunk_fields(fields), zframe]).data


def bomb(size: int, *, content_size: bool) -> bytes:
    """A zstd frame of ``size`` zero bytes, built without holding them in memory."""
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=content_size)
    out = compressor.compressobj(size=size if content_size else -1)
    block = bytes(1 << 20)
    parts = [out.compress(block[: min(len(block), size - i)]) for i in range(0, size, len(block))]
    return b"".join([*parts, out.flush()])


# Chunks of 64Ki int8 elements: a chunk body may hold up to about 74 KB, room for bombs.
BIG = encode_stream({"w": torch.zeros(1 << 16)}, CodecParams(), chunk_elements=1 << 16)
BIG_PAYLOAD = payload_size("int8", 1 << 16, 128)


def test_a_chunk_frame_small_enough_for_a_bomb_is_still_bounded_by_the_layout() -> None:
    frame = forged_chunk(STREAM, zframe=bomb(1 << 30, content_size=True))
    with pytest.raises(CorruptChunk, match=r"chunk body of \d+ bytes; chunks of this stream"):
        decode_all(STREAM.header + frame)


def test_a_chunk_declaring_a_larger_decoded_size_is_refused_unexpanded() -> None:
    frame = forged_chunk(BIG, decoded_size=1 << 40, zframe=bomb(1 << 30, content_size=True))
    with pytest.raises(
        DecodedSizeExceeded, match=f"declares 1099511627776 decoded bytes, not {BIG_PAYLOAD}"
    ):
        decode_all(BIG.header + frame)


def test_a_zstd_frame_declaring_a_larger_content_is_refused_unexpanded() -> None:
    frame = forged_chunk(BIG, zframe=bomb(1 << 30, content_size=True))
    with pytest.raises(
        DecodedSizeExceeded, match=f"zstd frame declares 1073741824 bytes, not {BIG_PAYLOAD}"
    ):
        decode_all(BIG.header + frame)


def test_a_zstd_frame_hiding_its_size_is_not_expanded() -> None:
    size = 1 << 30
    frame = forged_chunk(BIG, zframe=bomb(size, content_size=False))
    assert len(frame) < size // 10_000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CorruptChunk, match="zstd frame does not declare its content size"):
        decode_all(BIG.header + frame)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert (after - before) * 1024 < size // 8


def test_a_zstd_frame_with_more_data_behind_it_is_refused() -> None:
    zframe = zstandard.ZstdCompressor().compress(bytes(BIG_PAYLOAD))
    trailing = bomb(1 << 20, content_size=True)
    with pytest.raises(CorruptChunk, match="zstd"):
        decode_all(BIG.header + forged_chunk(BIG, zframe=zframe + trailing))


def test_a_zstd_frame_whose_content_exceeds_its_declared_size_is_refused() -> None:
    # A hand-made frame: header declaring BIG_PAYLOAD bytes, body of a longer frame.
    honest = zstandard.ZstdCompressor().compress(bytes(BIG_PAYLOAD))
    longer = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(4 * BIG_PAYLOAD))
    header_size = zstandard.frame_header_size(honest)
    forged = honest[:header_size] + longer[zstandard.frame_header_size(longer) :]
    with pytest.raises(CorruptChunk, match="zstd"):
        decode_all(BIG.header + forged_chunk(BIG, zframe=forged))


def test_a_chunk_frame_larger_than_any_chunk_can_be_is_refused_before_buffering() -> None:
    prefix = PREFIX.pack(b"GFDC", VERSION, FrameKind.CHUNK, 0, 1 << 50)
    decoder = StreamDecoder()
    list(decoder.feed(STREAM.header))
    with pytest.raises(CorruptChunk, match="chunk body of 1125899906842624 bytes"):
        list(decoder.feed(prefix))


def test_a_header_too_large_is_refused_before_buffering() -> None:
    prefix = PREFIX.pack(b"GFDC", VERSION, FrameKind.HEADER, 0, 1 << 40)
    with pytest.raises(CorruptStream, match="header body of 1099511627776 bytes exceeds"):
        list(StreamDecoder().feed(prefix))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"\xff", "header is not ASCII JSON"),
        (b"[" * 100_000, "header is not ASCII JSON"),
        (b"[]", "header fields list are not"),
        (
            b'{"block_size":16,"chunk_elements":128,"scheme":"int9","stochastic_rounding":false,'
            b'"tensors":[],"zstd_level":1}',
            "scheme 'int9' is not one of",
        ),
        (
            b'{"block_size":16,"chunk_elements":128,"scheme":"int8","stochastic_rounding":false,'
            b'"tensors":[["a","float32",[2]],["a","float32",[3]]],"zstd_level":1}',
            "tensor 'a' is listed twice",
        ),
        (
            b'{"block_size":16,"chunk_elements":128,"scheme":"int8","stochastic_rounding":false,'
            b'"tensors":[["a","float32",[-2]]],"zstd_level":1}',
            "has a size that is not an int >= 0",
        ),
        (
            b'{"block_size":true,"chunk_elements":128,"scheme":"int8","stochastic_rounding":0,'
            b'"tensors":[],"zstd_level":1}',
            "block_size must be an int, not bool",
        ),
    ],
)
def test_invalid_headers_are_refused(body: bytes, message: str) -> None:
    with pytest.raises(CorruptStream, match=message):
        decode_all(seal(FrameKind.HEADER, [body]).data)


def test_a_chunk_with_fields_off_the_layout_is_refused() -> None:
    slot_size = payload_size("int8", 128, 16)
    header_digest = bytes.fromhex(STREAM.header_digest)
    fields = ChunkFields(0, 0, SCHEME_CODES["int8"], 16, 128, slot_size, header_digest)
    zframe = zstandard.ZstdCompressor().compress(bytes(slot_size))
    frame = seal(FrameKind.CHUNK, [chunk_fields(fields), zframe]).data
    with pytest.raises(
        CorruptChunk, match=r"\(tensor, offset, count, scheme\) is \(0, 16, 128, 1\)"
    ):
        decode_all(STREAM.header + frame)


# -- decoder usage ---------------------------------------------------------------------


def test_feed_after_finish_and_after_failure_are_refused() -> None:
    decoder = StreamDecoder()
    list(decoder.feed(DATA))
    decoder.finish()
    with pytest.raises(DecoderStateError, match="feed\\(\\) after finish\\(\\)"):
        decoder.feed(b"")
    failed = StreamDecoder()
    with pytest.raises(UnsupportedVersion):
        list(failed.feed(b"x" * 64))
    with pytest.raises(
        DecoderStateError, match="on a decoder that failed: frame at stream byte 0: magic"
    ):
        failed.finish()


def test_an_unconsumed_feed_iterator_is_refused_not_lost() -> None:
    decoder = StreamDecoder()
    decoder.feed(DATA[:100])
    with pytest.raises(DecoderStateError, match="previous feed\\(\\) iterator was exhausted"):
        decoder.feed(DATA[100:])


def test_an_abandoned_feed_iterator_fails_the_decoder() -> None:
    decoder = StreamDecoder()
    pieces = decoder.feed(DATA)
    next(pieces)
    pieces.close()  # what breaking out of a for loop does
    with pytest.raises(DecoderStateError, match="iterator was closed early; pieces were lost"):
        decoder.feed(b"")


def test_buffer_for_receives_every_chunk() -> None:
    scratch = torch.empty(128)
    seen: list[tuple[str, int, int]] = []

    def buffer_for(name: str, offset: int, count: int) -> torch.Tensor:
        seen.append((name, offset, count))
        return scratch[:count]

    sums = [float(p.values.sum()) for p in decode_pieces(DATA, buffer_for=buffer_for)]
    reference = [float(p.values.sum()) for p in decode_pieces(DATA)]
    assert sums == reference
    assert seen == [(c.tensor, c.offset, c.count) for c in STREAM.chunks]


def test_buffer_for_must_return_a_fitting_tensor() -> None:
    with pytest.raises(InvalidConfig, match="must return a contiguous 1-D float32 CPU tensor"):
        list(decode_pieces(DATA, buffer_for=lambda name, offset, count: torch.empty(count + 1)))


def test_chunk_fields_layout_is_72_bytes_little_endian() -> None:
    assert CHUNK_FIELDS.size == 72
    raw = STREAM.chunks[1].data[PREFIX.size : PREFIX.size + CHUNK_FIELDS.size]
    index, tensor, scheme, compression, reserved, offset, count = struct.unpack_from(
        "<QIBBHQQ", raw
    )
    # Dense int8 codes are stored as they are (compression 1): zstd would gain little.
    assert (index, tensor, scheme, compression, reserved, offset, count) == (
        1,
        0,
        1,
        1,
        0,
        128,
        128,
    )
