"""A stored stream decoded side by side gives the whole-stream decoder's pieces, and
refuses what that decoder refuses."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from geofed.codec import (
    CorruptStream,
    DecodedSizeExceeded,
    OutOfOrder,
    Piece,
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
