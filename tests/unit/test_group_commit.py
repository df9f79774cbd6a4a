"""Group commit: concurrent frames share one commit, each answered only after it."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from coordinator.intake.chunk_commit import ChunkWrite, record_chunks
from coordinator.intake.group_commit import Batches, GroupCommit
from coordinator.intake.spool import Spool
from coordinator.state.sqlite import SqliteStore
from coordinator.state.store import ConflictError
from geofed.blobstore import FsBlobStore

DIGEST = "a" * 64


class GatedCommit:
    """A batch commit (the disk and database at the outer edge) that finishes on demand."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gates: list[asyncio.Event] = []
        self.fail_items: set[int] = set()
        self.fail_batch: Exception | None = None
        self.arrived = asyncio.Event()

    async def __call__(self, items: Sequence[int]) -> list[int | BaseException]:
        self.batches.append(list(items))
        gate = asyncio.Event()
        self.gates.append(gate)
        self.arrived.set()
        await gate.wait()
        if self.fail_batch is not None:
            raise self.fail_batch
        return [ValueError(f"item {i}") if i in self.fail_items else i * 10 for i in items]

    async def started(self, count: int) -> None:
        while len(self.batches) < count:
            self.arrived.clear()
            await self.arrived.wait()

    def release(self, batch: int) -> None:
        self.gates[batch].set()


async def no_wait(_delay: float) -> None:
    """The window, on simulated time: it ends at the next turn of the loop."""
    await asyncio.sleep(0)


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_batches_start_one_committer_and_gather_what_arrives_meanwhile() -> None:
    batches: Batches[str] = Batches(max_batch=2)
    assert batches.add("a") is True  # nothing runs: the caller starts the committer
    assert batches.add("b") is False
    assert batches.add("c") is False
    assert batches.take() == ["a", "b"]
    assert batches.add("d") is False  # arrives while the commit runs
    assert batches.finished() is True
    assert batches.take() == ["c", "d"]
    assert batches.finished() is False
    assert batches.add("e") is True  # the committer stopped; the next item starts one
    with pytest.raises(ValueError, match="max_batch"):
        Batches[str](max_batch=0)


async def test_items_arriving_together_share_one_commit_and_wait_for_it() -> None:
    commit = GatedCommit()
    group: GroupCommit[int, int] = GroupCommit(commit, window_s=0.001, sleep=no_wait)
    waiting = [asyncio.create_task(group.submit(i)) for i in range(5)]
    await commit.started(1)
    await settle()
    assert commit.batches == [[0, 1, 2, 3, 4]]
    assert not any(task.done() for task in waiting)  # none answered before the commit
    commit.release(0)
    assert await asyncio.gather(*waiting) == [0, 10, 20, 30, 40]
    assert (group.stats.commits, group.stats.items, group.stats.largest) == (1, 5, 5)


async def test_items_arriving_during_a_commit_form_the_next_one() -> None:
    commit = GatedCommit()
    group: GroupCommit[int, int] = GroupCommit(commit, sleep=no_wait)
    first = asyncio.create_task(group.submit(1))
    await commit.started(1)
    later = [asyncio.create_task(group.submit(i)) for i in (2, 3, 4)]
    await settle()
    assert commit.batches == [[1]]  # the commit in flight does not take them
    commit.release(0)
    assert await first == 10
    await commit.started(2)
    assert commit.batches == [[1], [2, 3, 4]]
    assert not any(task.done() for task in later)
    commit.release(1)
    assert await asyncio.gather(*later) == [20, 30, 40]
    assert group.stats.commits == 2


async def test_batches_are_bounded() -> None:
    commit = GatedCommit()
    group: GroupCommit[int, int] = GroupCommit(commit, max_batch=2, sleep=no_wait)
    waiting = [asyncio.create_task(group.submit(i)) for i in range(5)]
    for batch in range(3):
        await commit.started(batch + 1)
        commit.release(batch)
    assert await asyncio.gather(*waiting) == [0, 10, 20, 30, 40]
    assert commit.batches == [[0, 1], [2, 3], [4]]


async def test_an_item_fails_alone_and_a_failed_commit_fails_its_whole_batch() -> None:
    commit = GatedCommit()
    commit.fail_items = {2}
    group: GroupCommit[int, int] = GroupCommit(commit, sleep=no_wait)
    waiting = [asyncio.create_task(group.submit(i)) for i in range(3)]
    await commit.started(1)
    commit.release(0)
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert results[:2] == [0, 10]
    assert isinstance(results[2], ValueError)

    commit.fail_batch = OSError("disk gone")
    waiting = [asyncio.create_task(group.submit(i)) for i in range(2)]
    await commit.started(2)
    commit.release(1)
    for result in await asyncio.gather(*waiting, return_exceptions=True):
        assert isinstance(result, OSError)  # none acknowledged
    # The group still works afterwards.
    commit.fail_batch = None
    task = asyncio.create_task(group.submit(7))
    await commit.started(3)
    commit.release(2)
    assert await task == 70


async def test_a_cancelled_caller_does_not_withdraw_its_item() -> None:
    commit = GatedCommit()
    group: GroupCommit[int, int] = GroupCommit(commit, sleep=no_wait)
    gone = asyncio.create_task(group.submit(1))
    stays = asyncio.create_task(group.submit(2))
    await commit.started(1)
    gone.cancel()
    commit.release(0)
    assert await stays == 20
    assert commit.batches == [[1, 2]]
    assert gone.cancelled()


SIZES = (100, 7, 100)


def _spooled(tmp_path: Path) -> Spool:
    spool = Spool(tmp_path / "spool")
    spool.save_manifest("tiny", 3, "eu-west", DIGEST, b"manifest")
    return spool


def _write(spool: Spool, index: int, data: bytes) -> ChunkWrite:
    spool.write_chunk("tiny", 3, "eu-west", DIGEST, sum(SIZES[:index]), data)
    return ChunkWrite("tiny", 3, "eu-west", DIGEST, index, "b" * 63 + str(index), len(data))


def test_frames_land_at_their_offsets_in_any_order(tmp_path: Path) -> None:
    spool = _spooled(tmp_path)
    frames = [bytes([i + 1]) * size for i, size in enumerate(SIZES)]
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda i: _write(spool, i, frames[i]), (2, 0, 1)))
    stream = spool.stream_path("tiny", 3, "eu-west", DIGEST)
    assert stream.read_bytes() == b"".join(frames)
    assert stream.stat().st_mode & 0o777 == 0o600
    # The manifest sent again keeps what was received.
    spool.save_manifest("tiny", 3, "eu-west", DIGEST, b"manifest")
    assert stream.read_bytes() == b"".join(frames)


def test_a_frame_never_received_reads_short_or_as_zeros(tmp_path: Path) -> None:
    spool = _spooled(tmp_path)
    stream = spool.stream_path("tiny", 3, "eu-west", DIGEST)
    _write(spool, 0, b"x" * 100)
    assert stream.read_bytes() == b"x" * 100
    _write(spool, 2, b"z" * 100)
    assert stream.read_bytes() == b"x" * 100 + bytes(7) + b"z" * 100


def test_a_frame_whose_upload_vanished_is_refused(tmp_path: Path) -> None:
    spool = _spooled(tmp_path)
    spool.discard("tiny", 3, "eu-west")  # as if the upload was finished meanwhile
    with pytest.raises(FileNotFoundError):
        _write(spool, 1, b"y" * 7)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        spool.write_chunk("tiny", 3, "eu-west", DIGEST, -1, b"y")


def test_the_stream_file_becomes_the_blob(tmp_path: Path) -> None:
    spool = _spooled(tmp_path)
    for i, size in enumerate(SIZES):
        _write(spool, i, bytes([i]) * size)
    stream = spool.stream_path("tiny", 3, "eu-west", DIGEST)
    content = stream.read_bytes()
    digest = hashlib.sha256(content).hexdigest()
    blobs = FsBlobStore(tmp_path / "blobs")
    inode = stream.stat().st_ino
    blobs.adopt(stream, digest)
    assert not stream.exists()
    assert blobs.get(digest) == content
    assert blobs.path_of(digest).stat().st_ino == inode  # renamed, not copied
    # A second request finishing the same upload finds it stored: nothing to do.
    blobs.adopt(stream, digest)
    assert blobs.get(digest) == content
    # A copy of the same bytes is dropped, the stored blob kept.
    again = tmp_path / "again"
    again.write_bytes(content)
    blobs.adopt(again, digest)
    assert not again.exists()
    assert blobs.path_of(digest).stat().st_ino == inode


def test_rows_commit_together_and_a_conflicting_one_fails_alone(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    store.create_job("tiny", {}, "running")
    spool = _spooled(tmp_path)
    store.record_upload_chunk("tiny", 3, "eu-west", DIGEST, 1, "c" * 64, 10)
    writes = [_write(spool, i, b"z" * SIZES[i]) for i in range(3)]
    outcomes = record_chunks(store, writes)
    assert outcomes[0] is None
    assert outcomes[2] is None
    assert isinstance(outcomes[1], ConflictError)  # frame 1 already has another digest
    assert sorted(store.uploaded_chunks("tiny", 3, "eu-west", DIGEST)) == [0, 1, 2]
    assert store.uploaded_chunks("tiny", 3, "eu-west", DIGEST)[1] == "c" * 64
    store.close()
