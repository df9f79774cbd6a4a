"""Per-chunk compression (wire format version 2): stored and zstd chunks, the policy
that picks between them, and decoding of version 1 streams."""

from __future__ import annotations

import base64
import hashlib

import pytest
import torch
import zstandard

from geofed.codec import (
    CorruptChunk,
    CorruptStream,
    EncodedStream,
    EncodeError,
    decode,
    encode_stream,
)
from geofed.codec.compression import MIN_ZSTD_GAIN, PayloadBuffer
from geofed.codec.layout import payload_size
from geofed.codec.wire import (
    CHUNK_FIELDS,
    PREFIX,
    SCHEME_CODES,
    TAG_SIZE,
    ChunkFields,
    Compression,
    FrameKind,
    TrailerFields,
    chunk_fields,
    parse_chunk_fields,
    parse_trailer_body,
    seal,
    trailer_body,
)
from geofed.codec_params import CodecParams, Scheme

# A version 1 stream (int4, block 16, chunks of 128) written by the encoder before
# version 2, of the tensors ``golden_tensors()`` builds.
V1_INT4 = base64.b64decode(
    "R0ZEQwEBAACZAAAAAAAAAHsiYmxvY2tfc2l6ZSI6MTYsImNodW5rX2VsZW1lbnRzIjoxMjgsInNjaGVtZSI6ImludDQiLCJzdG9jaGFzdGljX3JvdW5kaW5nIjpmYWxzZSwidGVuc29ycyI6W1sidyIsImZsb2F0MzIiLFsyMCwxNV1dLFsiYiIsImZsb2F0MzIiLFs1XV1dLCJ6c3RkX2xldmVsIjoxfUkap4GhNfZ1cODmsMmHBtGwmaXIqOjn5sCJmoXciU0oR0ZEQwECAACWAAAAAAAAAAAAAAAAAAAAAAAAAAIAAAAAAAAAAAAAAIAAAAAAAAAAUAAAAAAAAADanx+2t27SmRpGyGOzRzgQTJA2YgwMlmbDCEBrL6leBii1L/0gUC0CABKEDhmwJekAJAzDAoyCcAqdwoxqhBXE8VoLNqW4KRmonyHUfqyifbLaP1r1t/p7kqwqQgGYwwTOcJCTEEEDBAIAqGhWxlebgZuQaBtGPDoeNacmly6ZY/Bhf0tSRj5UaQ0Bz8MiR0ZEQwECAAChAAAAAAAAAAEAAAAAAAAAAAAAAAIAAACAAAAAAAAAAIAAAAAAAAAAUAAAAAAAAADanx+2t27SmRpGyGOzRzgQTJA2YgwMlmbDCEBrL6leBii1L/0gUIECAN85Gjg6Okk7BjyMPPw8Tj0hQ1RldneHiHeIiIiImbr9mJmpqrvM3f6qurvLzN3u/ru7zMzd7e7/zMzM3d3u7v/M3N3d7e7+/9zd3e3u7v7/H/nFc3j6PIla9InttOTarccq/wZ4zCu5I0mURQectclHRkRDAQIAAG0AAAAAAAAAAgAAAAAAAAAAAAAAAgAAAAABAAAAAAAALAAAAAAAAAAcAAAAAAAAANqfH7a3btKZGkbIY7NHOBBMkDZiDAyWZsMIQGsvqV4GKLUv/SAc4QAAnj3kPRM+3d3d7u7u/v/d3e3u7u7//+7u7u7///bqkRCoLsbMGUUxhl2nAZ9+edz+fZ2oIl3+87ngp948R0ZEQwECAABWAAAAAAAAAAMAAAAAAAAAAQAAAAIAAAAAAAAAAAAAAAUAAAAAAAAABQAAAAAAAADanx+2t27SmRpGyGOzRzgQTJA2YgwMlmbDCEBrL6leBii1L/0gBSkAAJM9qNuPwBxi++ikhWLBXFdFUibyepwKAX4GSQQ1ZSsQDMlgBJ5HRkRDAQMAADgAAAAAAAAABAAAAAAAAAAxAQAAAAAAAIMDAAAAAAAA2fLN+VY/3YDDOIMpn3VJgr1/m2UfS9SgH34AqFBlnHhRkKx1WRM2R3bv7oQpZfkg92V6q4TjBgXwiCJgwDGb8A=="
)


def golden_tensors() -> dict[str, torch.Tensor]:
    return {
        "w": (torch.linspace(-1, 1, 300) ** 3).reshape(20, 15),
        "b": torch.linspace(0, 0.5, 5),
    }


def dense(count: int = 8192, seed: int = 0) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(count, generator=torch.Generator().manual_seed(seed))}


def heavy_tailed(count: int = 8192, seed: int = 0) -> dict[str, torch.Tensor]:
    """Mostly tiny values with rare large ones: most codes are near zero."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(count, generator=generator) * 1e-3
    spikes = torch.rand(count, generator=generator) < 0.01
    return {"x": torch.where(spikes, values * 1e3, values)}


def compressions(stream: EncodedStream) -> list[int]:
    return [parse_chunk_fields(chunk.data[PREFIX.size :]).compression for chunk in stream.chunks]


def encode_small(
    tensors: dict[str, torch.Tensor], scheme: Scheme = "int8", **kwargs: object
) -> EncodedStream:
    return encode_stream(
        tensors,
        CodecParams(scheme=scheme, block_size=128),
        chunk_elements=4096,
        **kwargs,  # type: ignore[arg-type]
    )


def test_version_1_streams_still_decode() -> None:
    assert V1_INT4[4] == 1
    old = decode(V1_INT4)
    # Same quantization, same zstd frames: only the version and compression bytes moved.
    v1_chunks = split_frames(V1_INT4)[1:-1]
    reencoded = encode_stream(
        golden_tensors(),
        CodecParams(scheme="int4", block_size=16),
        chunk_elements=128,
        compression="zstd",
    )
    for old_frame, chunk in zip(v1_chunks, reencoded.chunks, strict=True):
        start = PREFIX.size + CHUNK_FIELDS.size
        assert old_frame[start:-TAG_SIZE] == chunk.data[start:-TAG_SIZE]
    for name, tensor in decode(reencoded.to_bytes()).items():
        assert torch.equal(old[name], tensor)


def split_frames(data: bytes) -> list[bytes]:
    frames, position = [], 0
    while position < len(data):
        body_len = PREFIX.unpack_from(data, position)[4]
        size = PREFIX.size + body_len + TAG_SIZE
        frames.append(data[position : position + size])
        position += size
    return frames


def test_auto_stores_dense_int8_and_compresses_what_pays() -> None:
    assert set(compressions(encode_small(dense()))) == {Compression.NONE}
    assert set(compressions(encode_small(heavy_tailed()))) == {Compression.ZSTD}
    assert set(compressions(encode_small(dense(), "fp32"))) == {Compression.ZSTD}
    # int4 is chosen for the fewest bytes: zstd stays whenever it shrinks the codes at all.
    assert set(compressions(encode_small(dense(), "int4"))) == {Compression.ZSTD}
    sparse = {"x": torch.zeros(4096)}
    assert set(compressions(encode_small(sparse))) == {Compression.ZSTD}


def student_t2(count: int = 1 << 15, seed: int = 0) -> dict[str, torch.Tensor]:
    """Student's t with 2 degrees of freedom: zstd gains about 1.3x on its int8 codes."""
    generator = torch.Generator().manual_seed(seed)
    z, a, b = (torch.randn(count, generator=generator) for _ in range(3))
    return {"x": z / ((a * a + b * b) / 2).sqrt()}


def test_auto_stores_int8_chunks_that_zstd_shrinks_by_less_than_a_third() -> None:
    tensors = student_t2()
    forced = encode_small(tensors, compression="zstd")
    stored = encode_small(tensors, compression="none")
    gain = stored.total_bytes / forced.total_bytes
    # The codes compress, but not by enough to be worth their CPU time.
    assert 1.15 < gain < MIN_ZSTD_GAIN
    auto = encode_small(tensors)
    assert set(compressions(auto)) == {Compression.NONE}
    assert auto.to_bytes() == stored.to_bytes()
    # int4 codes of the same data keep zstd, which shrinks them at all.
    assert set(compressions(encode_small(tensors, "int4"))) == {Compression.ZSTD}


@pytest.mark.parametrize("scheme", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("make", [dense, heavy_tailed])
def test_every_policy_decodes_to_the_same_values(scheme: Scheme, make: object) -> None:
    tensors = make()  # type: ignore[operator]
    decoded = {
        policy: decode(encode_small(tensors, scheme, compression=policy).to_bytes())["x"]
        for policy in ("auto", "zstd", "none")
    }
    assert torch.equal(decoded["auto"], decoded["zstd"])
    assert torch.equal(decoded["auto"], decoded["none"])
    assert set(compressions(encode_small(tensors, scheme, compression="none"))) == {
        Compression.NONE
    }
    assert set(compressions(encode_small(tensors, scheme, compression="zstd"))) == {
        Compression.ZSTD
    }


def test_auto_only_compresses_when_the_stream_shrinks_enough() -> None:
    for make in (dense, heavy_tailed):
        tensors = make(1 << 16)
        auto = encode_small(tensors)
        stored = encode_small(tensors, compression="none")
        framing = PREFIX.size + CHUNK_FIELDS.size + TAG_SIZE
        for chunk, raw in zip(auto.chunks, stored.chunks, strict=True):
            if len(chunk.data) != len(raw.data):
                gain = (len(raw.data) - framing) / (len(chunk.data) - framing)
                assert gain >= MIN_ZSTD_GAIN


def test_encoding_is_deterministic_under_every_policy_and_zstd_threads() -> None:
    tensors = heavy_tailed(1 << 15)
    for policy in ("auto", "zstd", "none"):
        first = encode_small(tensors, compression=policy).to_bytes()
        assert encode_small(tensors, compression=policy).to_bytes() == first
        assert encode_small(tensors, compression=policy, workers=2).to_bytes() == first
    # zstd's multi-threaded mode writes the same bytes whatever its number of threads.
    one = encode_small(tensors, compression="zstd", zstd_threads=1)
    two = encode_small(tensors, compression="zstd", zstd_threads=2)
    assert one.to_bytes() == two.to_bytes()
    assert torch.equal(decode(one.to_bytes())["x"], decode(first)["x"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compression": "lz4"}, "compression 'lz4' is not one of auto, zstd, none"),
        ({"zstd_threads": -1}, "zstd_threads -1 must be an int from 0 to 256"),
        ({"zstd_threads": True}, "zstd_threads True must be an int"),
    ],
)
def test_bad_compression_options_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(EncodeError, match=message):
        encode_small(dense(), "int8", **kwargs)


# -- hostile chunks --------------------------------------------------------------------

STREAM = encode_small(dense(), compression="none")
SIZE = payload_size("int8", 4096, 128)


def chunk_frame(
    payload: bytes, *, compression: int, reserved: int = 0, version: int = 2, decoded: int = SIZE
) -> bytes:
    fields = ChunkFields(
        index=0,
        tensor=0,
        scheme_code=SCHEME_CODES["int8"],
        offset=0,
        count=4096,
        decoded_size=decoded,
        header_digest=bytes.fromhex(STREAM.header_digest),
        compression=compression,
        reserved=reserved,
    )
    return seal(FrameKind.CHUNK, [chunk_fields(fields), payload], version=version).data


def stream_with(chunk0: bytes) -> bytes:
    """STREAM with chunk 0 replaced by chunk0, trailer rechained to fit."""
    chunks = [chunk0, *(chunk.data for chunk in STREAM.chunks[1:])]
    chained = hashlib.sha256(bytes.fromhex(STREAM.header_digest))
    for frame in chunks:
        chained.update(hashlib.sha256(frame).digest())
    old = parse_trailer_body(STREAM.trailer[PREFIX.size : -TAG_SIZE])
    size = len(STREAM.header) + sum(len(frame) for frame in chunks)
    fields = TrailerFields(old.chunk_count, old.total_elements, size, chained.digest())
    trailer = seal(FrameKind.TRAILER, [trailer_body(fields)]).data
    return b"".join([STREAM.header, *chunks, trailer])


def original_payload() -> bytes:
    return STREAM.chunks[0].data[PREFIX.size + CHUNK_FIELDS.size : -TAG_SIZE]


def test_a_rebuilt_stream_decodes() -> None:
    assert STREAM.chunks[0].data == chunk_frame(original_payload(), compression=1)
    assert torch.equal(
        decode(stream_with(STREAM.chunks[0].data))["x"], decode(STREAM.to_bytes())["x"]
    )
    zframe = zstandard.ZstdCompressor(write_content_size=True).compress(original_payload())
    assert torch.equal(
        decode(stream_with(chunk_frame(zframe, compression=0)))["x"],
        decode(STREAM.to_bytes())["x"],
    )


@pytest.mark.parametrize("delta", [-1, 1, 64])
def test_a_stored_payload_of_the_wrong_size_is_refused(delta: int) -> None:
    payload = original_payload()
    payload = payload[:delta] if delta < 0 else payload + bytes(delta)
    with pytest.raises(CorruptChunk, match=f"stored payload of {SIZE + delta} bytes, not {SIZE}"):
        decode(stream_with(chunk_frame(payload, compression=1)))


def test_a_stored_payload_can_not_raise_the_size_limit() -> None:
    huge = bytes(SIZE + (1 << 20))
    with pytest.raises(CorruptChunk, match="chunk body of"):
        decode(stream_with(chunk_frame(huge, compression=1, decoded=len(huge))))


@pytest.mark.parametrize(("compression", "reserved"), [(2, 0), (255, 0), (1, 1), (0, 0x100)])
def test_unknown_compression_codes_and_reserved_bits_are_refused(
    compression: int, reserved: int
) -> None:
    frame = chunk_frame(original_payload(), compression=compression, reserved=reserved)
    with pytest.raises(CorruptChunk, match=f"compression code {compression} and reserved"):
        decode(stream_with(frame))


def test_a_stored_chunk_is_refused_in_a_version_1_stream() -> None:
    header = V1_INT4[: len(split_frames(V1_INT4)[0])]
    fields = parse_chunk_fields(split_frames(V1_INT4)[1][PREFIX.size :])
    size = payload_size("int4", 128, 16)
    forged = ChunkFields(
        fields.index,
        fields.tensor,
        fields.scheme_code,
        fields.offset,
        fields.count,
        size,
        fields.header_digest,
        compression=Compression.NONE,
    )
    frame = seal(FrameKind.CHUNK, [chunk_fields(forged), bytes(size)], version=1).data
    with pytest.raises(CorruptChunk, match="not valid in a version 1 stream"):
        decode(header + frame)


def test_frames_of_another_version_are_refused() -> None:
    frame = chunk_frame(original_payload(), compression=0, version=1)
    with pytest.raises(CorruptStream, match="wire-format version 1 in a version 2 stream"):
        decode(stream_with(frame))


def test_payload_buffer_reuses_its_memory() -> None:
    buffer = PayloadBuffer()
    first = buffer.fill(b"abcd")
    assert bytes(first.numpy()) == b"abcd"
    second = buffer.fill(memoryview(b"xy"))
    assert bytes(second.numpy()) == b"xy"
    assert second.data_ptr() == first.data_ptr()
    assert bytes(buffer.fill(bytes(100)).numpy()) == bytes(100)
