"""The awaitable state store: calls and transactions run in the store thread."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from coordinator.executors import Executors
from coordinator.rounds.records import JobState
from coordinator.state.async_store import AsyncStore
from coordinator.state.audit import AuditEvent, AuditVerdict
from coordinator.state.sqlite import SqliteStore
from coordinator.state.store import AlreadyExists, Store
from coordinator.state.transactions import LOCATION_POINTER, record_admitted_job
from geofed.blobstore import sha256_hex
from geofed.types import Identity, Role

OPERATOR = Identity("acme", Role.OPERATOR, "alice")
M, B = sha256_hex(b"manifest"), sha256_hex(b"blob")


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[AsyncStore]:
    executors = Executors(compute_threads=1, file_threads=1)
    db = await AsyncStore.open(lambda: SqliteStore.in_state_dir(tmp_path), executors)
    yield db
    await db.close()
    executors.shutdown()


async def test_run_calls_the_function_with_the_store_in_the_store_thread(db: AsyncStore) -> None:
    def where(store: Store, job: str, *, extra: int) -> tuple[str, str, int]:
        assert isinstance(store, SqliteStore)
        return threading.current_thread().name, job, extra

    thread, job, extra = await db.run(where, "job-a", extra=7)
    assert thread.startswith("geofed-store")
    assert (job, extra) == ("job-a", 7)


async def test_a_transaction_commits_whole_and_its_errors_reach_the_caller(
    db: AsyncStore,
) -> None:
    await db.run(record_admitted_job, "job-a", {"job": "job-a"}, "eu-ckpt", OPERATOR, 3)
    job = await db.get_job("job-a")
    assert job is not None
    assert job.state == JobState.RUNNING.value
    assert await db.get_pointer("job-a", LOCATION_POINTER) == "eu-ckpt"
    [entry] = await db.audit_entries(job="job-a")
    assert (entry.action, entry.verdict, entry.details) == (
        "job.admit",
        "allow",
        {"checkpoint_location": "eu-ckpt", "decisions": 3},
    )
    with pytest.raises(AlreadyExists):
        await db.run(record_admitted_job, "job-a", {"job": "job-a"}, "us-ckpt", OPERATOR, 3)
    assert await db.get_pointer("job-a", LOCATION_POINTER) == "eu-ckpt"
    assert (await db.audit_head())[0] == 1


async def test_receipt_finds_one_regions_receipt(db: AsyncStore) -> None:
    await db.create_job("job-a", {"job": "job-a"}, JobState.RUNNING.value)
    stored = await db.record_receipt("job-a", 2, "eu-west", M, B, 100, 64)
    await db.record_receipt("job-a", 2, "us-east", M, B, 100, 64)
    assert await db.receipt("job-a", 2, "eu-west") == stored
    assert await db.receipt("job-a", 2, "ap-south") is None
    assert await db.receipt("job-a", 3, "eu-west") is None


async def test_an_audit_event_is_appended_and_verifies(db: AsyncStore) -> None:
    entry = await db.append_audit(
        AuditEvent(OPERATOR, "job.pause", AuditVerdict.OK, job="job-a", details={"n": 1})
    )
    assert (entry.seq, entry.actor, entry.verdict) == (1, OPERATOR.uri, "ok")
    assert await db.audit_entries() == [entry]
    assert (await db.verify_audit(expect_head=await db.audit_head())).ok
