"""The status page's audit follower: bounded reading per page view, over a real store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from coordinator.api.ui.handler import AuditFollower
from coordinator.executors import Executors
from coordinator.state.async_store import AsyncStore
from coordinator.state.audit import MAX_PAGE, AuditEvent, AuditVerdict
from coordinator.state.sqlite import SqliteStore
from coordinator.state.store import Store
from geofed.types import Identity, Role

COORD = Identity("fed", Role.COORDINATOR, "main")
ENTRIES = 2 * MAX_PAGE + 500


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[AsyncStore]:
    executors = Executors(compute_threads=1, file_threads=1)
    db = await AsyncStore.open(lambda: SqliteStore.in_state_dir(tmp_path), executors)
    yield db
    await db.close()
    executors.shutdown()


def _fill(store: Store, count: int) -> None:
    with store.transaction():  # one commit: the test is about reading
        for number in range(count):
            _append(store, number)


def _append(store: Store, number: int) -> None:
    store.append_audit(
        AuditEvent(
            actor=COORD,
            action="delta.accept",
            verdict=AuditVerdict.ALLOW,
            job="llm",
            round=number,
            region="eu-west",
            details={"size": 10, "tokens": 1, "train_loss": 1.0},
        )
    )


async def test_each_view_reads_a_bounded_number_of_pages_and_catches_up(db: AsyncStore) -> None:
    await db.run(_fill, ENTRIES)
    follower = AuditFollower()
    async with follower.lock:
        head = await follower.catch_up(db, pages=1)
    assert head == ENTRIES
    assert follower.digest.seq == MAX_PAGE  # the rest on later views
    async with follower.lock:
        await follower.catch_up(db, pages=1)
        await follower.catch_up(db, pages=5)
    assert follower.digest.seq == ENTRIES
    assert follower.digest.chain.ok
    assert follower.digest.chain.checked == ENTRIES
    assert follower.digest.jobs["llm"].deltas == ENTRIES
    await db.run(_fill, 3)
    async with follower.lock:
        assert await follower.catch_up(db) == ENTRIES + 3
    assert follower.digest.seq == ENTRIES + 3
