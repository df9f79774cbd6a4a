"""Deterministic, resumable batch positions in a byte stream.

The stream is cut into non-overlapping windows; rank ``r`` of ``world_size`` owns the
windows whose index is ``r`` modulo ``world_size`` (so ranks never share data) and
visits them in a fresh seeded permutation each epoch. Sample ``i`` of a rank is a pure
function of ``(key, i)``, so the batch at any step can be computed without replaying
the ones before it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


class SamplingError(ValueError):
    """The stream is too short for the windows and ranks asked of it."""


def derive_seed(*parts: object) -> int:
    """Return a 63-bit seed from ``parts``, the same in every process (unlike ``hash``)."""
    text = "/".join(repr(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little") >> 1


@dataclass(slots=True)
class WindowSampler:
    """Start offsets of one rank's windows of ``window`` bytes in a ``stream_len`` stream."""

    stream_len: int
    window: int
    rank: int
    world_size: int
    key: tuple[object, ...]
    per_rank: int = field(init=False)
    _epoch: int = field(init=False, default=-1)
    _perm: torch.Tensor = field(init=False, default_factory=lambda: torch.empty(0))

    def __post_init__(self) -> None:
        if self.window < 1:
            raise SamplingError(f"window must be >= 1, got {self.window}")
        if not 0 <= self.rank < self.world_size:
            raise SamplingError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        # Every rank gets the same count so that all ranks' epochs end together.
        self.per_rank = self.stream_len // self.window // self.world_size
        if self.per_rank < 1:
            raise SamplingError(
                f"a stream of {self.stream_len} bytes holds fewer than {self.world_size} "
                f"windows of {self.window} bytes"
            )

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(derive_seed(*self.key, self.rank, epoch))
            self._perm = torch.randperm(self.per_rank, generator=generator)
            self._epoch = epoch
        return self._perm

    def starts(self, first: int, count: int) -> torch.Tensor:
        """Return the byte offsets of samples ``first .. first+count-1`` (int64)."""
        if first < 0 or count < 0:
            raise SamplingError(f"sample range must be non-negative, got {first}+{count}")
        index = torch.arange(first, first + count, dtype=torch.int64)
        epochs = index // self.per_rank
        positions = index % self.per_rank
        local = torch.empty_like(index)
        for epoch in torch.unique(epochs).tolist():
            mask = epochs == epoch
            local[mask] = self._permutation(int(epoch))[positions[mask]]
        return (local * self.world_size + self.rank) * self.window
