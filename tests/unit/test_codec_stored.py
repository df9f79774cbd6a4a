"""A stored stream decoded side by side gives the whole-stream decoder's pieces, and
refuses what that decoder refuses."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest
import torch

from geofed.codec import (
    CorruptStream,
    DecodedSizeExceeded,
    DigestMismatch,
    OutOfOrder,
    Piece,
    StreamDecoder,
    TruncatedStream,
    decode,
    encode_stream,
)
from geofed.codec.stored import decode_stored
from geofed.codec_params import CodecParams

INT8 = CodecParams(scheme="int8", block_size=32, zstd_level=1)


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        "embed.weight": torch.randn(40, 17, generator=generator),
        "empty": torch.zeros(0),
        "layer.bias": torch.randn(33, generator=generator),
        "head.weight": torch.randn(7, 40, generator=generator),
    }


def _stored(tmp_path: Path, frames: list[bytes]) -> Path:
    path = tmp_path / "stream"
    path.write_bytes(b"".join(frames))
    return path


def _frames() -> list[bytes]:
    return [bytes(frame) for frame in encode_stream(_tensors(), INT8, chunk_elements=64).frames()]


def _collected(path: Path, workers: int) -> dict[str, torch.Tensor]:
    shapes = {name: t.shape for name, t in _tensors().items()}
    out = {name: torch.full((t.numel(),), float("nan")) for name, t in _tensors().items()}
    lock = threading.Lock()
    seen: list[tuple[str, int]] = []

    def consume(piece: Piece) -> None:
        out[piece.name][piece.offset : piece.offset + piece.count] = piece.values
        with lock:
            seen.append((piece.name, piece.offset))

    decode_stored(path, consume, workers=workers)
    assert len(seen) == len(set(seen))  # each piece once
    return {name: tensor.reshape(shapes[name]) for name, tensor in out.items()}


@pytest.mark.parametrize("workers", [1, 2, 3, 50])
def test_side_by_side_gives_the_whole_stream_decoders_bits(tmp_path: Path, workers: int) -> None:
    frames = _frames()
    expected = decode(frames)
    got = _collected(_stored(tmp_path, frames), workers)
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_a_damaged_chunk_is_refused(tmp_path: Path) -> None:
    frames = _frames()
    damaged = bytearray(frames[3])
    damaged[40] ^= 0x01
    frames[3] = bytes(damaged)
    with pytest.raises(CorruptStream, match="tag"):
        _collected(_stored(tmp_path, frames), 3)


def test_chunks_out_of_place_are_refused(tmp_path: Path) -> None:
    frames = _frames()
    frames[2], frames[3] = frames[3], frames[2]
    with pytest.raises(OutOfOrder):
        _collected(_stored(tmp_path, frames), 2)


def test_a_stream_cut_short_or_without_its_header_is_refused(tmp_path: Path) -> None:
    frames = _frames()
    whole = b"".join(frames)
    (tmp_path / "cut").write_bytes(whole[:-10])
    with pytest.raises(TruncatedStream):
        decode_stored(tmp_path / "cut", lambda piece: None)
    (tmp_path / "headless").write_bytes(b"".join(frames[1:]))
    with pytest.raises(CorruptStream, match="header"):
        decode_stored(tmp_path / "headless", lambda piece: None)
    (tmp_path / "short").write_bytes(b"".join([*frames[:2], *frames[3:]]))
    with pytest.raises(CorruptStream, match="chunk frames"):
        decode_stored(tmp_path / "short", lambda piece: None)


def test_a_consumers_error_reaches_the_caller(tmp_path: Path) -> None:
    def refuse(piece: Piece) -> None:
        raise ValueError(f"no room for {piece.name}")

    with pytest.raises(ValueError, match="no room"):
        decode_stored(_stored(tmp_path, _frames()), refuse, workers=2)


def test_a_stream_bigger_than_allowed_is_refused_at_its_header(tmp_path: Path) -> None:
    with pytest.raises(DecodedSizeExceeded):
        decode_stored(_stored(tmp_path, _frames()), lambda piece: None, max_decoded_bytes=64)


def test_every_frame_is_checked_against_the_digests_expected(tmp_path: Path) -> None:
    frames = _frames()
    path = _stored(tmp_path, frames)
    digests = [hashlib.sha256(frame).hexdigest() for frame in frames]
    decode_stored(path, lambda piece: None, workers=2, expected_digests=digests)
    for index in (0, 5, len(frames) - 1):  # the header, a chunk, the trailer
        wrong = list(digests)
        wrong[index] = "0" * 64
        with pytest.raises(DigestMismatch):
            decode_stored(path, lambda piece: None, workers=2, expected_digests=wrong)
    with pytest.raises(CorruptStream, match="digests expected"):
        decode_stored(path, lambda piece: None, expected_digests=digests[:-1])


def test_the_header_is_checked_before_any_chunk_is_decoded(tmp_path: Path) -> None:
    decoded: list[Piece] = []

    def refuse(decoder: StreamDecoder) -> None:
        assert [spec.name for spec in decoder.specs] == list(_tensors())
        raise ValueError("not this model")

    with pytest.raises(ValueError, match="not this model"):
        decode_stored(_stored(tmp_path, _frames()), decoded.append, check_header=refuse)
    assert decoded == []


def test_a_chunk_from_another_stream_of_the_same_layout_is_refused(tmp_path: Path) -> None:
    # Every frame well formed, each chunk in its place under the same header: only the
    # trailer's digest chain over the chunks tells the streams apart.
    frames = _frames()
    other = encode_stream({name: t + 1 for name, t in _tensors().items()}, INT8, chunk_elements=64)
    frames[4] = bytes(list(other.frames())[4])
    with pytest.raises(CorruptStream, match="stream digest"):
        decode_stored(_stored(tmp_path, frames), lambda piece: None, workers=3)


def test_the_files_sha256_is_returned(tmp_path: Path) -> None:
    frames = _frames()
    whole = hashlib.sha256(b"".join(frames)).hexdigest()
    assert decode_stored(_stored(tmp_path, frames), lambda piece: None, workers=2) == whole


def test_data_after_the_trailer_is_refused(tmp_path: Path) -> None:
    frames = _frames()
    for extra in (b"xy", frames[1]):
        with pytest.raises(CorruptStream, match="after the stream trailer"):
            decode_stored(_stored(tmp_path, [*frames, extra]), lambda piece: None)


def test_a_stream_of_empty_tensors_only_decodes_to_nothing(tmp_path: Path) -> None:
    frames = [bytes(f) for f in encode_stream({"e": torch.zeros(0)}, INT8).frames()]
    decoded: list[Piece] = []
    decode_stored(_stored(tmp_path, frames), decoded.append, workers=4)
    assert decoded == []
