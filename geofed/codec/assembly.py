"""Decoding whole streams: all pieces at once, or whole tensors in their own dtype."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from geofed.codec.decoder import Piece, StreamDecoder
from geofed.codec.tensors import TensorLayout
from geofed.codec.wire import Bytes


def decode_pieces(
    data: Bytes | Iterable[Bytes],
    *,
    expected_digests: Sequence[str] | None = None,
    expected_header_digest: str | None = None,
    max_decoded_bytes: int | None = None,
    buffer_for: Callable[[str, int, int], torch.Tensor] | None = None,
) -> Iterator[Piece]:
    """Yield the pieces of a whole stream given as bytes or as an iterable of byte parts."""
    decoder = StreamDecoder(
        expected_digests=expected_digests,
        expected_header_digest=expected_header_digest,
        max_decoded_bytes=max_decoded_bytes,
        buffer_for=buffer_for,
    )
    parts = [data] if isinstance(data, bytes | bytearray | memoryview) else data
    for part in parts:
        yield from decoder.feed(part)
    decoder.finish()


def decode(
    data: Bytes | Iterable[Bytes],
    *,
    expected_digests: Sequence[str] | None = None,
    expected_header_digest: str | None = None,
    max_decoded_bytes: int | None = None,
) -> dict[str, torch.Tensor]:
    """Decode a whole stream into CPU tensors of their original dtype and shape.

    For input from an untrusted source pass ``max_decoded_bytes``: the tensors are
    allocated as the header describes them.
    """
    target = _Target(lambda: decoder.specs)
    decoder = StreamDecoder(
        expected_digests=expected_digests,
        expected_header_digest=expected_header_digest,
        max_decoded_bytes=max_decoded_bytes,
        buffer_for=target.buffer_for,
    )
    parts = [data] if isinstance(data, bytes | bytearray | memoryview) else data
    for part in parts:
        for piece in decoder.feed(part):
            target.store(piece)
    decoder.finish()
    return target.tensors()


class _Target:
    """Whole tensors that :func:`decode` fills, float32 ones decoded in place."""

    def __init__(self, specs: Callable[[], list[TensorLayout]]) -> None:
        self._specs = specs
        self._tensors: dict[str, torch.Tensor] | None = None
        self._scratch = torch.empty(0, dtype=torch.float32)

    def tensors(self) -> dict[str, torch.Tensor]:
        if self._tensors is None:
            self._tensors = {
                spec.name: torch.empty(spec.shape, dtype=spec.torch_dtype) for spec in self._specs()
            }
        return self._tensors

    def buffer_for(self, name: str, offset: int, count: int) -> torch.Tensor:
        flat = self.tensors()[name].view(-1)
        if flat.dtype == torch.float32:
            return flat[offset : offset + count]
        if self._scratch.numel() < count:
            self._scratch = torch.empty(count, dtype=torch.float32)
        return self._scratch[:count]

    def store(self, piece: Piece) -> None:
        flat = self.tensors()[piece.name].view(-1)
        if flat.dtype != torch.float32:
            flat[piece.offset : piece.offset + piece.count].copy_(piece.values)
