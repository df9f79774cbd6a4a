"""The round driver's transactions commit all of their writes or none."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.rounds.records import JobState
from coordinator.state.sqlite import SqliteStore
from coordinator.state.store import ConflictError, InvalidValue
from coordinator.state.transactions import (
    DeltaOffer,
    accept_delta,
    record_job_failure,
    record_publication,
    upload_pointer,
)
from geofed.types import Identity, Role

COORDINATOR = Identity("acme", Role.COORDINATOR, "main")
EU = Identity("acme", Role.REGION, "eu-west")


@pytest.fixture
def store(tmp_path: Path) -> SqliteStore:
    store = SqliteStore.in_state_dir(tmp_path)
    store.create_job("tiny", {"job": "tiny"}, JobState.RUNNING.value)
    store.set_pointer("tiny", "version", "3")
    return store


def _offer(digest: str = "aa" * 32) -> DeltaOffer:
    return DeltaOffer("eu-west", 3, digest, "bb" * 32, 100, 64, 1.5, EU)


def test_a_publication_moves_pointers_and_records_the_round_together(store: SqliteStore) -> None:
    with pytest.raises(InvalidValue):
        record_publication(
            store, "tiny", 3, {"phase": "published"}, {"version": "4"},
            completed=True, actor=COORDINATOR, details={"loss": float("nan")},
        )  # fmt: skip
    # The audit entry could not be written, so nothing else was either.
    assert store.get_pointer("tiny", "version") == "3"
    assert store.load_round("tiny", 3) is None
    assert store.get_job("tiny").state == "running"  # type: ignore[union-attr]
    assert store.audit_head()[0] == 0

    record_publication(
        store, "tiny", 3, {"phase": "published"}, {"version": "4"},
        completed=True, actor=COORDINATOR, details={"update": "cc" * 32},
    )  # fmt: skip
    assert store.get_pointer("tiny", "version") == "4"
    assert store.load_round("tiny", 3).state == {"phase": "published"}  # type: ignore[union-attr]
    assert store.get_job("tiny").state == "completed"  # type: ignore[union-attr]
    assert [e.action for e in store.audit_entries()] == ["round.publish"]


def test_accepting_a_delta_is_idempotent_and_a_different_one_changes_nothing(
    store: SqliteStore,
) -> None:
    store.set_pointer("tiny", upload_pointer(3, "eu-west"), "aa" * 32)
    first = accept_delta(store, "tiny", _offer(), {"delivered": ["eu-west"]}, "accepted")
    assert store.get_pointer("tiny", upload_pointer(3, "eu-west")) == ""
    again = accept_delta(store, "tiny", _offer(), {"delivered": ["eu-west"]}, "accepted")
    assert again == first
    with pytest.raises(ConflictError):
        accept_delta(store, "tiny", _offer("dd" * 32), {"delivered": ["other"]}, "accepted")
    assert store.load_round("tiny", 3).state == {"delivered": ["eu-west"]}  # type: ignore[union-attr]
    assert [r.manifest_digest for r in store.list_receipts("tiny", 3)] == ["aa" * 32]


def test_a_failed_job_is_recorded_with_its_reason(store: SqliteStore) -> None:
    record_job_failure(store, "tiny", COORDINATOR, "round 3 failed 3 time(s)")
    assert store.get_job("tiny").state == "failed"  # type: ignore[union-attr]
    (entry,) = store.audit_entries()
    assert (entry.action, entry.details["reason"]) == ("job.fail", "round 3 failed 3 time(s)")
