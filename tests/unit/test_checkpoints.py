"""The global checkpoint chain: ordering, idempotency, interrupted writes, pruning."""

from __future__ import annotations

import errno
import io
import json
from pathlib import Path

import pytest

from coordinator.storage.checkpoints import (
    CheckpointConflict,
    CheckpointEntry,
    CheckpointOrderError,
    CheckpointStore,
    CorruptIndex,
    EntryKind,
    MissingBlob,
)
from geofed.blobstore import sha256_hex
from geofed.fsutil import AtomicFile
from geofed.types import InvalidName
from tests.support.checkpoints import (
    JOB,
    assert_restorable,
    open_store,
    put_pair,
    snapshot,
    update,
)


class FullDiskFile(io.FileIO):
    """Fake disk at the outer edge: takes ``capacity`` bytes, then fails with ENOSPC."""

    def __init__(self, fd: int, capacity: int) -> None:
        super().__init__(fd, "wb")
        self.room = capacity

    def write(self, b) -> int:
        data = bytes(b)[: self.room]
        super().write(data)
        self.room -= len(data)
        raise OSError(errno.ENOSPC, "No space left on device")


def failing_index_writer(path: Path, data: bytes) -> None:
    """Writes half the index through the real atomic writer, then the disk fills up."""
    with AtomicFile(path, fdopen=lambda fd: FullDiskFile(fd, len(data) // 2)) as f:
        f.write(data)


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return open_store(tmp_path / "eu-vault")


def test_no_checkpoint_yet(store: CheckpointStore) -> None:
    assert store.latest(JOB) is None
    assert store.entries(JOB) == []
    assert store.jobs() == []


def test_chain_of_snapshot_and_updates(store: CheckpointStore) -> None:
    snap = snapshot(store, 0)
    ups = [update(store, r) for r in range(4)]
    chain = store.latest(JOB)
    assert chain is not None
    assert chain.snapshot == snap
    assert chain.updates == tuple(ups)
    assert (chain.base_round, chain.round) == (0, 4)
    assert chain.location == "eu-vault"
    assert chain.digests()[:2] == [snap.payload_digest, snap.manifest_digest]
    assert store.blobs.get(ups[2].payload_digest) == f"payload {JOB} update 2".encode()
    assert store.jobs() == [JOB]
    doc = chain.to_json()
    assert doc["round"] == 4
    assert [u["round"] for u in doc["updates"]] == [0, 1, 2, 3]


def test_new_snapshot_starts_a_new_chain(store: CheckpointStore) -> None:
    snapshot(store, 0)
    for r in range(3):
        update(store, r)
    snap3 = snapshot(store, 3)
    up3 = update(store, 3)
    up4 = update(store, 4)
    chain = store.latest(JOB)
    assert chain is not None
    assert chain.snapshot == snap3
    assert chain.updates == (up3, up4)
    assert chain.round == 5
    kinds = [(e.kind.value, e.round) for e in store.entries(JOB)]
    assert kinds == [
        ("snapshot", 0),
        ("update", 0),
        ("update", 1),
        ("update", 2),
        ("snapshot", 3),
        ("update", 3),
        ("update", 4),
    ]


def test_first_snapshot_may_start_at_any_round(store: CheckpointStore) -> None:
    snapshot(store, 17)
    update(store, 17)
    chain = store.latest(JOB)
    assert chain is not None
    assert chain.round == 18


def test_order_is_enforced(store: CheckpointStore) -> None:
    with pytest.raises(CheckpointOrderError, match="no snapshot yet"):
        update(store, 0)
    snapshot(store, 2)
    with pytest.raises(CheckpointOrderError, match="must be round 2, got 3"):
        update(store, 3)
    with pytest.raises(CheckpointOrderError, match="must be round 2, got 1"):
        update(store, 1)
    update(store, 2)
    update(store, 3)
    with pytest.raises(CheckpointOrderError, match="older than its newest checkpoint version 4"):
        snapshot(store, 3)
    with pytest.raises(CheckpointOrderError, match="non-negative"):
        store.record_snapshot(JOB, -1, *put_pair(store, "neg"))
    assert [(e.kind.value, e.round) for e in store.entries(JOB)] == [
        ("snapshot", 2),
        ("update", 2),
        ("update", 3),
    ]


def test_recording_is_idempotent_and_conflicts_are_refused(store: CheckpointStore) -> None:
    snap = snapshot(store, 0)
    up = update(store, 0)
    assert snapshot(store, 0) == snap
    assert update(store, 0) == up
    with pytest.raises(CheckpointConflict, match="different update for round 0"):
        store.record_update(JOB, 0, *put_pair(store, "other"))
    with pytest.raises(CheckpointConflict, match="different snapshot for round 0"):
        store.record_snapshot(JOB, 0, *put_pair(store, "other"))
    assert store.entries(JOB) == [snap, up]


def test_unstored_blob_is_never_referenced(store: CheckpointStore) -> None:
    snapshot(store, 0)
    payload = store.blobs.put(b"payload")
    absent = sha256_hex(b"never stored")
    with pytest.raises(MissingBlob, match=absent):
        store.record_update(JOB, 0, payload, absent)
    with pytest.raises(MissingBlob, match=absent):
        store.record_update(JOB, 0, absent, payload)
    chain = store.latest(JOB)
    assert chain is not None
    assert chain.updates == ()


def test_invalid_arguments(store: CheckpointStore, tmp_path: Path) -> None:
    with pytest.raises(InvalidName):
        store.record_snapshot("../evil", 0, *put_pair(store, "x"))
    with pytest.raises(InvalidName):
        store.latest("Bad_Job")
    with pytest.raises(ValueError, match="sha256"):
        store.record_snapshot(JOB, 0, "not-a-digest", sha256_hex(b""))
    with pytest.raises(InvalidName):
        CheckpointStore("Not A Location", tmp_path / "x")
    with pytest.raises(ValueError, match="keep_snapshots"):
        store.prune(JOB, keep_snapshots=0)
    assert store.entries(JOB) == []


def test_interrupted_index_write_keeps_previous_chain(store: CheckpointStore) -> None:
    snapshot(store, 0)
    update(store, 0)
    before = store.latest(JOB)
    failing = CheckpointStore(
        "eu-vault", store.root, blobs=store.blobs, write_index=failing_index_writer
    )
    payload, manifest = put_pair(store, "update 1")  # the blob writes succeed...
    with pytest.raises(OSError, match="No space left"):
        failing.record_update(JOB, 1, payload, manifest)  # ...the index write does not
    assert store.latest(JOB) == before
    assert_restorable(store)
    assert not list(store.root.rglob("*.tmp"))
    # The retry on a healthy disk records it.
    assert store.record_update(JOB, 1, payload, manifest).round == 1
    chain = store.latest(JOB)
    assert chain is not None
    assert chain.round == 2


def test_persists_across_instances(store: CheckpointStore) -> None:
    snapshot(store, 0)
    update(store, 0)
    reopened = CheckpointStore("eu-vault", store.root)
    assert reopened.latest(JOB) == store.latest(JOB)
    assert reopened.entries(JOB) == store.entries(JOB)


def test_locations_are_separate(tmp_path: Path) -> None:
    eu = CheckpointStore("eu-vault", tmp_path / "eu")
    us = CheckpointStore("us-vault", tmp_path / "us")
    snapshot(eu, 0)
    assert us.latest(JOB) is None
    assert not us.blobs.exists(eu.entries(JOB)[0].payload_digest)
    snapshot(us, 5)
    us_chain, eu_chain = us.latest(JOB), eu.latest(JOB)
    assert us_chain is not None
    assert eu_chain is not None
    assert (us_chain.location, us_chain.round) == ("us-vault", 5)
    assert (eu_chain.location, eu_chain.round) == ("eu-vault", 0)


def test_missing_snapshot_blob_falls_back_to_older_snapshot(store: CheckpointStore) -> None:
    snap0 = snapshot(store, 0)
    ups = [update(store, r) for r in range(3)]
    snap3 = snapshot(store, 3)
    up3 = update(store, 3)
    store.blobs.delete(snap3.payload_digest)
    chain = store.latest(JOB)
    assert chain is not None
    assert chain.snapshot == snap0
    assert chain.updates == (*ups, up3)
    assert chain.round == 4  # still the newest version


def test_missing_update_blob_is_reported_not_skipped(store: CheckpointStore) -> None:
    snapshot(store, 0)
    up0 = update(store, 0)
    update(store, 1)
    store.blobs.delete(up0.manifest_digest)
    with pytest.raises(MissingBlob, match=f"blob {up0.manifest_digest} of the update of round 0"):
        store.latest(JOB)


def test_prune_keeps_newest_snapshots_and_their_chains(store: CheckpointStore) -> None:
    snap0 = snapshot(store, 0)
    up0, up1 = update(store, 0), update(store, 1)
    snapshot(store, 2)
    update(store, 2)
    snapshot(store, 3)
    update(store, 3)
    result = store.prune(JOB, keep_snapshots=2)
    assert result.removed == (snap0, up0, up1)
    removed_digests = {d for e in result.removed for d in e.digests()}
    assert set(result.deleted_blobs) == removed_digests
    for digest in removed_digests:
        assert not store.blobs.exists(digest)
    assert [(e.kind.value, e.round) for e in store.entries(JOB)] == [
        ("snapshot", 2),
        ("update", 2),
        ("snapshot", 3),
        ("update", 3),
    ]
    chain = store.latest(JOB)
    assert chain is not None
    assert chain.round == 4
    assert_restorable(store)
    assert store.prune(JOB, keep_snapshots=2).removed == ()


def test_prune_keeps_blobs_other_jobs_still_use(store: CheckpointStore) -> None:
    # Two jobs that start from the same initial parameters share the snapshot blobs.
    shared = put_pair(store, "shared init")
    store.record_snapshot("job-a", 0, *shared)
    store.record_snapshot("job-b", 0, *shared)
    update(store, 0, job="job-a")
    snapshot(store, 1, job="job-a")
    result = store.prune("job-a", keep_snapshots=1)
    assert [e.round for e in result.removed] == [0, 0]
    assert not set(shared) & set(result.deleted_blobs)
    assert all(store.blobs.exists(d) for d in shared)
    assert_restorable(store, "job-b")


def test_corrupt_index_is_reported(store: CheckpointStore) -> None:
    snapshot(store, 0)
    index = store.root / "jobs" / JOB / "index.json"
    index.write_text("{not json")
    with pytest.raises(CorruptIndex, match=r"index\.json"):
        store.latest(JOB)
    index.write_text(json.dumps({"format": 1, "job": "job-other", "entries": []}))
    with pytest.raises(CorruptIndex):
        store.latest(JOB)
    index.write_text(json.dumps({"format": 1, "job": JOB, "entries": [{"kind": "bogus"}]}))
    with pytest.raises(CorruptIndex):
        store.entries(JOB)


def test_entry_json_round_trip(store: CheckpointStore) -> None:
    entry = snapshot(store, 4)
    assert CheckpointEntry.from_json(entry.to_json()) == entry
    assert entry.kind is EntryKind.SNAPSHOT
