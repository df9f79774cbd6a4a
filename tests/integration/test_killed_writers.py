"""A writer process killed midway leaves the last committed state behind.

Real child processes (``multiprocessing``, spawn) die inside a write: an atomic file, the
checkpoint chain, a state-store transaction. The same modules' in-process failure cases
(a full disk, a failing flush) are unit tests: ``tests/unit/test_fsutil.py``,
``tests/unit/test_checkpoints.py``, ``tests/unit/test_store.py``.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.state.audit import AuditEvent
from coordinator.storage.checkpoints import CheckpointStore
from geofed.blobstore import sha256_hex
from geofed.fsutil import AtomicFile
from tests.support.checkpoints import assert_restorable, open_store, snapshot, update
from tests.support.stores import (
    B2,
    IMPLEMENTATIONS,
    JOB,
    M2,
    OPERATOR,
    StoreFactory,
    die_mid_transaction,
    with_job,
)

# -- an atomic file --------------------------------------------------------------------------

OLD = b"old content that must survive\n"


def _die_while_writing(path: str) -> None:
    with AtomicFile(path) as f:
        f.write(b"half of the new content")
        f.flush()
        os._exit(1)


def test_process_killed_midway_leaves_old_content(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_bytes(OLD)
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_die_while_writing, args=(str(target),))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 1
    assert target.read_bytes() == OLD
    # A crash leaves at most a hidden temp file beside the target, never a torn target.
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp"))
    assert all(name.startswith(".state.json.") for name in leftovers)


# -- the checkpoint chain --------------------------------------------------------------------


def _crash_between_blobs_and_index(root: str) -> None:
    store = CheckpointStore("eu-vault", root)
    payload = store.blobs.put(b"orphan payload")
    store.blobs.put(b"orphan manifest")
    assert payload
    os._exit(1)  # dies before record_update writes the index


def test_crash_between_blob_and_index_write(tmp_path: Path) -> None:
    store = open_store(tmp_path / "eu-vault")
    snapshot(store, 0)
    update(store, 0)
    before = store.latest(JOB)
    child = multiprocessing.get_context("spawn").Process(
        target=_crash_between_blobs_and_index, args=(str(store.root),)
    )
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 1
    reopened = CheckpointStore("eu-vault", store.root)
    assert reopened.latest(JOB) == before
    assert_restorable(reopened)
    assert reopened.blobs.exists(sha256_hex(b"orphan payload"))  # an orphan, unreferenced
    chain = reopened.latest(JOB)
    assert chain is not None
    assert sha256_hex(b"orphan payload") not in chain.digests()


# -- a state-store transaction (part of the store contract, for every implementation) -------


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def store_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreFactory]:
    factory = StoreFactory.for_implementation(request.param, tmp_path)
    yield factory
    factory.close_all()


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_process_dying_mid_transaction_leaves_last_commit(
    store_factory: StoreFactory, how: str
) -> None:
    parent = with_job(store_factory())
    parent.save_round(JOB, 1, {"phase": "open"})
    head = parent.append_audit(AuditEvent(OPERATOR, "round.open", "ok", job=JOB))
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=die_mid_transaction, args=(store_factory.spec, ready, how))
    child.start()
    if how == "kill":
        assert ready.wait(60), "child never reached the middle of its transaction"
        child.kill()
    child.join(timeout=60)
    assert child.exitcode == (1 if how == "exit" else -9)

    for store in (parent, store_factory()):
        assert store.get_job("job-half") is None
        rnd = store.load_round(JOB, 1)
        assert rnd is not None
        assert rnd.state == {"phase": "open"}
        assert [r.region for r in store.list_receipts(JOB, 1)] == ["eu-west"]
        assert store.get_pointer(JOB, "params") is None
        assert store.audit_entries() == [head]
        assert store.verify_audit(expect_head=(head.seq, head.hash)).ok
    # Nothing is left locked: the survivor writes at once.
    parent.record_receipt(JOB, 1, "us-east", M2, B2, 200, 20)
    assert len(parent.list_receipts(JOB, 1)) == 2
