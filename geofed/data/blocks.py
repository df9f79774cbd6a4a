"""The deterministic block schedule: flat token files cut into training blocks.

A block is ``seq_len + 1`` consecutive tokens of one file: a model reads the first
``seq_len`` and predicts the last ``seq_len``. Block ``k`` of a file starts at token
``k * seq_len``, so consecutive blocks share one token and every token of the file is a
prediction target once. Blocks never cross files.

:func:`split` holds out the last blocks for validation; :func:`batch_indices` says which
training blocks a rank trains on at a step, as a pure function of the seed, the shard and
the step, so a batch never changes and a restart at any step continues exactly.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

from geofed.data.location import DataError

__all__ = ["TokenBlocks", "batch_indices", "split", "validation_batches"]

_TokenArray = np.memmap[Any, np.dtype[Any]]


class TokenBlocks:
    """The blocks of flat token files, in file order.

    ``files`` pairs each file with its element type (``numpy.uint16`` or ``uint32``).
    Files are memory-mapped read-only on first use and kept open. A file shorter than
    ``seq_len + 1`` tokens contributes no block; no block at all raises DataError.
    """

    def __init__(self, files: Sequence[tuple[Path, np.dtype[Any]]], seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self._seq_len = seq_len
        self._files = [(Path(path), np.dtype(dtype)) for path, dtype in files]
        self._tokens: list[int] = []
        self._starts: list[int] = []  # index of each file's first block
        total = 0
        for path, dtype in self._files:
            tokens = _token_count(path, dtype)
            self._tokens.append(tokens)
            self._starts.append(total)
            total += (tokens - 1) // seq_len if tokens > 0 else 0
        if total == 0:
            names = ", ".join(str(path) for path, _ in self._files) or "no files"
            raise DataError(f"{names}: no block of {seq_len + 1} tokens (seq_len {seq_len})")
        self._len = total
        self._maps: dict[int, _TokenArray] = {}

    @property
    def seq_len(self) -> int:
        """Tokens a model reads per block (a block holds one more)."""
        return self._seq_len

    def __len__(self) -> int:
        return self._len

    def block(self, index: int) -> torch.Tensor:
        """Block ``index`` (in file order) as int64 tokens of shape ``[seq_len + 1]``."""
        if not 0 <= index < self._len:
            raise IndexError(f"block {index} out of range [0, {self._len})")
        file = bisect.bisect_right(self._starts, index) - 1
        start = (index - self._starts[file]) * self._seq_len
        tokens = self._map(file)[start : start + self._seq_len + 1]
        return torch.from_numpy(np.array(tokens, dtype=np.int64))

    def _map(self, file: int) -> _TokenArray:
        mapped = self._maps.get(file)
        if mapped is None:
            path, dtype = self._files[file]
            try:
                mapped = np.memmap(path, dtype=dtype, mode="r", shape=(self._tokens[file],))
            except OSError as error:
                raise DataError(f"{path}: cannot map: {error.strerror}") from error
            self._maps[file] = mapped
        return mapped

    def __getstate__(self) -> dict[str, Any]:
        # Pickling a memmap copies the whole file (a DataLoader worker would receive it);
        # a copy maps its files again instead.
        state = self.__dict__.copy()
        state["_maps"] = {}
        return state


def _token_count(path: Path, dtype: np.dtype[Any]) -> int:
    try:
        size = path.stat().st_size
    except OSError as error:
        raise DataError(f"{path}: cannot stat: {error.strerror}") from error
    if size % dtype.itemsize:
        raise DataError(
            f"{path}: {size} bytes is not a whole number of {dtype.name} tokens "
            f"({dtype.itemsize} bytes each); is dtype right?"
        )
    return size // dtype.itemsize


def split(n_blocks: int, val_fraction: float, min_val: int = 1) -> tuple[range, range]:
    """Split ``n_blocks`` blocks into (training, validation) block ranges.

    Validation is the last ``v = max(min_val, ceil(n_blocks * val_fraction))`` blocks:
    a contiguous tail is the same for every seed and rank, and shares no document with
    training except at most the one it is cut from. Training ends one block before the
    validation tail: consecutive blocks share a token (block ``k`` ends on the token block
    ``k + 1`` starts with), so with the block between them left out the last training
    block ends ``seq_len`` tokens before validation begins and no token is in both. That
    drops one block; ``v = 0`` holds nothing out and drops nothing. A training range left
    empty raises ValueError ("too little data").
    """
    if n_blocks < 0:
        raise ValueError(f"n_blocks must be >= 0, got {n_blocks}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if min_val < 0:
        raise ValueError(f"min_val must be >= 0, got {min_val}")
    # The fraction as written (0.07, not the binary 0.0700000000000000067...), so that
    # 100 blocks at 0.07 hold out 7, not 8.
    held_out = max(min_val, math.ceil(n_blocks * Fraction(repr(val_fraction))))
    if held_out == 0:
        return range(n_blocks), range(n_blocks, n_blocks)
    train_end = n_blocks - held_out - 1
    if train_end < 1:
        raise ValueError(f"too little data: {n_blocks} blocks, cannot hold out {held_out}")
    return range(train_end), range(n_blocks - held_out, n_blocks)


def batch_indices(
    n_train: int, *, seed: int, rank: int, world_size: int, step: int, batch_size: int
) -> list[int]:
    """The training blocks (indices into ``range(n_train)``) of ``rank`` at ``step``.

    Sample ``j`` of (rank, step) is at global position ``p = (step * world_size + rank) *
    batch_size + j``; epoch ``p // n_train`` visits the blocks in a permutation seeded by
    (seed, epoch), and the sample is that permutation's entry ``p % n_train``. So within
    an epoch no two samples of any ranks share a block, each epoch reorders, and the
    batch at (rank, step) is the same in every run. The permutation is torch's CPU
    ``randperm``: every worker of a job must run the same torch release.
    """
    if n_train < 1:
        raise ValueError(f"n_train must be >= 1, got {n_train}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"no rank {rank} in a world of {world_size}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    first = (step * world_size + rank) * batch_size
    indices: list[int] = []
    for position in range(first, first + batch_size):
        epoch, offset = divmod(position, n_train)
        indices.append(int(_epoch_order(n_train, seed, epoch)[offset]))
    return indices


@functools.lru_cache(maxsize=4)
def _epoch_order(n_train: int, seed: int, epoch: int) -> torch.Tensor:
    # Cached: every step of every rank asks for the current epoch's order again, and
    # a batch at an epoch boundary needs two. Callers only read it.
    digest = hashlib.sha256(f"geofed.data.blocks:{seed}:{epoch}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)
    return torch.randperm(n_train, generator=generator)


def validation_batches(val: range, *, batch_size: int, count: int) -> list[list[int]]:
    """The first ``count`` batches of consecutive validation blocks, in order.

    Fewer when ``val`` runs out; the last may be short. Blocks are never repeated.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    return [
        list(val[start : start + batch_size])
        for start in range(0, min(len(val), count * batch_size), batch_size)
    ]
