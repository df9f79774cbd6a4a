"""The block schedule: blocks of flat token files, the held-out tail, and each step's batch."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from geofed.data import DataError, TokenBlocks, batch_indices, split, validation_batches
from geofed.data.blocks import _epoch_order

U16 = np.dtype(np.uint16)


def write_tokens(path: Path, tokens: list[int] | range, dtype: np.dtype = U16) -> Path:
    np.asarray(tokens, dtype=dtype).tofile(path)
    return path


def test_blocks_per_file_and_their_tokens(tmp_path: Path) -> None:
    nine = write_tokens(tmp_path / "a.bin", range(9))  # blocks at 0 and 4
    ten = write_tokens(tmp_path / "b.bin", range(100, 110))  # token 109 ends no block
    five = write_tokens(tmp_path / "c.bin", range(200, 205))  # exactly one block
    blocks = TokenBlocks([(nine, U16), (ten, U16), (five, U16)], seq_len=4)
    assert len(blocks) == 2 + 2 + 1
    assert blocks.seq_len == 4
    assert [blocks.block(i).tolist() for i in range(len(blocks))] == [
        [0, 1, 2, 3, 4],
        [4, 5, 6, 7, 8],
        [100, 101, 102, 103, 104],
        [104, 105, 106, 107, 108],
        [200, 201, 202, 203, 204],
    ]


def test_a_block_is_int64_of_seq_len_plus_one(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "a.bin", range(65_000, 65_100))
    block = TokenBlocks([(path, U16)], seq_len=8).block(3)
    assert block.dtype == torch.int64
    assert block.shape == (9,)
    assert block.tolist() == list(range(65_024, 65_033))


def test_consecutive_blocks_share_one_token_and_every_token_is_a_target(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "a.bin", range(1, 42))  # 41 tokens, seq_len 5: 8 blocks
    blocks = TokenBlocks([(path, U16)], seq_len=5)
    assert len(blocks) == 8
    for k in range(len(blocks) - 1):
        assert blocks.block(k)[-1] == blocks.block(k + 1)[0]
    targets = [t for k in range(len(blocks)) for t in blocks.block(k)[1:].tolist()]
    assert targets == list(range(2, 42))


def test_files_shorter_than_a_block_give_none(tmp_path: Path) -> None:
    empty = write_tokens(tmp_path / "empty.bin", [])
    short = write_tokens(tmp_path / "short.bin", range(4))
    full = write_tokens(tmp_path / "full.bin", range(10, 15))
    blocks = TokenBlocks([(empty, U16), (short, U16), (full, U16), (short, U16)], seq_len=4)
    assert len(blocks) == 1
    assert blocks.block(0).tolist() == [10, 11, 12, 13, 14]


def test_no_block_at_all_names_the_files_and_seq_len(tmp_path: Path) -> None:
    short = write_tokens(tmp_path / "short.bin", range(4))
    message = re.escape(f"{short}: no block of 5 tokens (seq_len 4)")
    with pytest.raises(DataError, match=message):
        TokenBlocks([(short, U16)], seq_len=4)


def test_uint32_files(tmp_path: Path) -> None:
    u32 = np.dtype(np.uint32)
    path = write_tokens(tmp_path / "a.bin", [70_000, 1, 2**32 - 1], dtype=u32)
    assert TokenBlocks([(path, u32)], seq_len=2).block(0).tolist() == [70_000, 1, 2**32 - 1]


def test_a_size_not_a_multiple_of_the_dtype_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "a.bin"
    path.write_bytes(b"\0" * 10)
    with pytest.raises(DataError, match=re.escape(f"{path}: 10 bytes is not a whole number")):
        TokenBlocks([(path, np.dtype(np.uint32))], seq_len=1)


def test_indices_outside_are_index_errors(tmp_path: Path) -> None:
    blocks = TokenBlocks([(write_tokens(tmp_path / "a.bin", range(9)), U16)], seq_len=4)
    for index in (-1, 2, 10):
        with pytest.raises(IndexError, match=f"block {index} out of range"):
            blocks.block(index)


def test_a_pickled_copy_maps_its_files_again(tmp_path: Path) -> None:
    blocks = TokenBlocks([(write_tokens(tmp_path / "a.bin", range(9)), U16)], seq_len=4)
    first = blocks.block(1).tolist()
    copy = pickle.loads(pickle.dumps(blocks))
    assert len(pickle.dumps(blocks)) < 1000
    assert copy.block(1).tolist() == first


def test_split_holds_out_the_tail_and_drops_one_block_before_it() -> None:
    assert split(100, 0.1) == (range(89), range(90, 100))
    assert split(100, 0.07) == (range(92), range(93, 100))  # 7, not ceil(7.000000000000001)
    assert split(10, 0.01, min_val=3) == (range(6), range(7, 10))
    assert split(3, 0.0) == (range(1), range(2, 3))
    assert split(5, 0.0, min_val=0) == (range(5), range(5, 5))


@pytest.mark.parametrize(("n_blocks", "fraction", "seq_len"), [(100, 0.1, 4), (7, 0.3, 1)])
def test_training_and_validation_share_no_token(
    n_blocks: int, fraction: float, seq_len: int
) -> None:
    train, val = split(n_blocks, fraction)

    def tokens(block: int) -> set[int]:
        return set(range(block * seq_len, block * seq_len + seq_len + 1))

    train_tokens = set().union(*(tokens(b) for b in train))
    val_tokens = set().union(*(tokens(b) for b in val))
    assert not train_tokens & val_tokens
    assert max(train_tokens) < min(val_tokens)


def test_too_little_data_to_hold_out() -> None:
    with pytest.raises(ValueError, match="too little data: 2 blocks, cannot hold out 1"):
        split(2, 0.1)
    with pytest.raises(ValueError, match="too little data: 10 blocks, cannot hold out 9"):
        split(10, 0.85)


def test_batch_indices_are_a_pure_function_of_their_arguments() -> None:
    args = {"seed": 7, "rank": 1, "world_size": 2, "step": 5, "batch_size": 4}
    first = batch_indices(1000, **args)
    _epoch_order.cache_clear()
    assert batch_indices(1000, **args) == first
    assert batch_indices(1000, **{**args, "seed": 8}) != first
    assert all(0 <= i < 1000 for i in first)


def test_ranks_cover_each_block_once_an_epoch() -> None:
    n_train, world, batch = 24, 3, 2
    steps_per_epoch = n_train // (world * batch)

    def epoch(e: int) -> list[int]:
        return [
            i
            for step in range(e * steps_per_epoch, (e + 1) * steps_per_epoch)
            for rank in range(world)
            for i in batch_indices(
                n_train, seed=3, rank=rank, world_size=world, step=step, batch_size=batch
            )
        ]

    first, second = epoch(0), epoch(1)
    assert sorted(first) == list(range(n_train))
    assert sorted(second) == list(range(n_train))
    assert first != second


def test_a_batch_may_straddle_two_epochs() -> None:
    # With one rank and a batch of the whole epoch, step e's batch is epoch e's order.
    orders = [batch_indices(5, seed=11, rank=0, world_size=1, step=e, batch_size=5) for e in (0, 1)]
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(5))
    batch = batch_indices(5, seed=11, rank=0, world_size=1, step=1, batch_size=3)
    assert batch == [orders[0][3], orders[0][4], orders[1][0]]


def test_a_restart_continues_exactly() -> None:
    def run(steps: range) -> list[list[int]]:
        return [
            batch_indices(50, seed=1, rank=r, world_size=2, step=s, batch_size=4)
            for s in steps
            for r in range(2)
        ]

    straight = run(range(20))
    _epoch_order.cache_clear()  # a fresh process
    assert run(range(9)) + run(range(9, 20)) == straight
    _epoch_order.cache_clear()
    assert run(range(9, 20)) == straight[18:]


def test_batch_indices_refuse_bad_arguments() -> None:
    good = {"seed": 0, "rank": 0, "world_size": 1, "step": 0, "batch_size": 1}
    for n_train, bad in [
        (0, {}),
        (5, {"rank": 1}),
        (5, {"world_size": 0}),
        (5, {"step": -1}),
        (5, {"batch_size": 0}),
    ]:
        with pytest.raises(ValueError):
            batch_indices(n_train, **{**good, **bad})


def test_validation_batches_are_consecutive_and_never_wrap() -> None:
    val = range(90, 100)
    assert validation_batches(val, batch_size=4, count=2) == [[90, 91, 92, 93], [94, 95, 96, 97]]
    assert validation_batches(val, batch_size=4, count=9) == [
        [90, 91, 92, 93],
        [94, 95, 96, 97],
        [98, 99],
    ]
    assert validation_batches(val, batch_size=4, count=0) == []
    assert validation_batches(range(5, 5), batch_size=4, count=3) == []
