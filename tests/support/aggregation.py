"""Region deltas as the aggregation tests feed them: fixed tensors, the decoded pieces the
codec would give (a fake at the outer edge), and a bit-exact comparison."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

SPECS = {"w": (6, 7), "b": (5,), "s": ()}


@dataclass(frozen=True)
class FakePiece:
    """Stands in for the codec's decoded piece (name, offset, count, values)."""

    name: str
    offset: int
    count: int
    values: torch.Tensor


def delta(seed: int, specs=SPECS) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in specs.items()}


def pieces(tensors: dict[str, torch.Tensor], chunk: int = 8, shuffle_seed: int | None = None):
    out = []
    for name, tensor in tensors.items():
        flat = tensor.reshape(-1)
        for offset in range(0, flat.numel(), chunk):
            values = flat[offset : offset + chunk].clone()
            out.append(FakePiece(name, offset, values.numel(), values))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(out)
    return out


def source(tensors: dict[str, torch.Tensor], **kwargs):
    """A piece source as the daemon would pass it: decodes when called."""
    return lambda: pieces(tensors, **kwargs)


def assert_bit_identical(a, b) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].shape == b[name].shape
        assert torch.equal(a[name].view(torch.int32), b[name].view(torch.int32)), name
