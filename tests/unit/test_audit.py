"""The hash-chained audit log: appending, paging, tamper detection, shared transactions."""

from __future__ import annotations

import dataclasses
import itertools
import math
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.state.audit import (
    GENESIS_HASH,
    AuditEntry,
    AuditEvent,
    AuditLog,
    AuditVerdict,
    InvalidAuditEntry,
    canonical_json,
    format_time,
    verify_chain,
)
from geofed.types import Identity, Role

OPERATOR = Identity("fed", Role.OPERATOR, "alice")
REGION = Identity("fed", Role.REGION, "eu-west")


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        self.now += 0.5
        return self.now


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "audit.db"


@pytest.fixture
def log(db_path: Path) -> Iterator[AuditLog]:
    audit = AuditLog.open(db_path, clock=Clock())
    yield audit
    audit.close()


def fill(log: AuditLog, n: int) -> list[AuditEntry]:
    return [
        log.append(
            AuditEvent(
                actor=REGION if i % 2 else OPERATOR,
                action="delta.accept" if i % 2 else "job.create",
                verdict=AuditVerdict.OK,
                job="job-a" if i % 3 else "job-b",
                round=i,
                region="eu-west",
                details={"i": i, "bytes": 1000 * i, "note": "ünïcode"},
            )
        )
        for i in range(n)
    ]


def tamper(db_path: Path, *statements: str) -> None:
    """What an attacker with file access could do: drop the guards and edit rows."""
    conn = sqlite3.connect(db_path, isolation_level=None)
    try:
        conn.execute("DROP TRIGGER audit_log_no_update")
        conn.execute("DROP TRIGGER audit_log_no_delete")
        for statement in statements:
            conn.execute(statement)
    finally:
        conn.close()


def test_append_builds_a_chain(log: AuditLog) -> None:
    entries = fill(log, 5)
    assert [e.seq for e in entries] == [1, 2, 3, 4, 5]
    assert entries[0].prev_hash == GENESIS_HASH
    for before, after in itertools.pairwise(entries):
        assert after.prev_hash == before.hash
    for entry in entries:
        assert entry.hash == entry.compute_hash()
        assert len(entry.hash) == 64
    assert entries[0].actor == "spiffe://fed/operator/alice"
    assert entries[0].time == "2023-11-14T22:13:20.500000Z"
    assert log.entries() == entries
    result = log.verify()
    assert result.ok
    assert (result.checked, result.head_seq, result.head_hash) == (5, 5, entries[-1].hash)
    assert log.head() == (5, entries[-1].hash)


def test_empty_log_verifies(log: AuditLog) -> None:
    assert log.head() == (0, GENESIS_HASH)
    assert log.verify().ok
    assert log.verify(expect_head=(0, GENESIS_HASH)).ok
    assert log.entries() == []


def test_entries_paging_and_job_filter(log: AuditLog) -> None:
    entries = fill(log, 12)
    assert log.entries(after_seq=3, limit=4) == entries[3:7]
    assert log.entries(after_seq=12) == []
    only_b = log.entries(job="job-b")
    assert [e.seq for e in only_b] == [1, 4, 7, 10]
    assert log.entries(after_seq=4, limit=1, job="job-b") == [entries[6]]
    with pytest.raises(ValueError, match="limit"):
        log.entries(limit=0)
    with pytest.raises(ValueError, match="limit"):
        log.entries(limit=1001)
    with pytest.raises(ValueError, match="after_seq"):
        log.entries(after_seq=-1)


def test_client_side_verification_of_json_pages(log: AuditLog) -> None:
    fill(log, 10)
    # What a client receives from GET /v1/audit, page by page.
    page1 = [e.to_dict() for e in log.entries(limit=4)]
    page2 = [e.to_dict() for e in log.entries(after_seq=4, limit=100)]
    parsed1 = [AuditEntry.from_dict(d) for d in page1]
    parsed2 = [AuditEntry.from_dict(d) for d in page2]
    first = verify_chain(parsed1)
    assert first.ok
    assert verify_chain(parsed2, prev_hash=first.head_hash).ok
    assert verify_chain(parsed2).ok  # a middle page alone trusts its first prev_hash
    # A page that does not continue from the previous one is caught.
    result = verify_chain(parsed2[1:], prev_hash=first.head_hash)
    assert not result.ok
    assert result.first_bad_seq == 6


def test_from_dict_rejects_malformed_entries(log: AuditLog) -> None:
    good = fill(log, 1)[0].to_dict()
    assert AuditEntry.from_dict(good).to_dict() == good
    for field, value in [("seq", "1"), ("seq", True), ("details", []), ("hash", None)]:
        with pytest.raises(InvalidAuditEntry, match=field):
            AuditEntry.from_dict({**good, field: value})
    missing = dict(good)
    del missing["prev_hash"]
    with pytest.raises(InvalidAuditEntry, match="prev_hash"):
        AuditEntry.from_dict(missing)


def test_triggers_refuse_update_and_delete(log: AuditLog, db_path: Path) -> None:
    fill(log, 3)
    conn = sqlite3.connect(db_path, isolation_level=None)
    try:
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            conn.execute("UPDATE audit_log SET verdict = 'deny' WHERE seq = 2")
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            conn.execute("DELETE FROM audit_log WHERE seq = 3")
    finally:
        conn.close()
    assert log.verify().ok


@pytest.mark.parametrize(
    ("statement", "bad_seq", "reason"),
    [
        ("UPDATE audit_log SET verdict = 'deny' WHERE seq = 3", 3, "content does not match"),
        ("UPDATE audit_log SET details = '{\"i\":99}' WHERE seq = 4", 4, "content does not match"),
        ("UPDATE audit_log SET details = 'not json' WHERE seq = 2", 2, "content does not match"),
        ("UPDATE audit_log SET hash = '" + "1" * 64 + "' WHERE seq = 5", 5, "does not match"),
        ("DELETE FROM audit_log WHERE seq = 3", 3, "entry 3 is missing"),
        ("DELETE FROM audit_log WHERE seq = 1", 1, "entry 1 is missing"),
        ("UPDATE audit_log SET prev_hash = '" + "2" * 64 + "' WHERE seq = 1", 1, "genesis"),
    ],
)
def test_verify_pinpoints_tampering(
    log: AuditLog, db_path: Path, statement: str, bad_seq: int, reason: str
) -> None:
    fill(log, 8)
    tamper(db_path, statement)
    result = log.verify()
    assert not result.ok
    assert result.first_bad_seq == bad_seq
    assert reason in result.reason
    assert result.checked == bad_seq - 1


def test_rewritten_entry_with_recomputed_hash_breaks_the_next_link(
    log: AuditLog, db_path: Path
) -> None:
    entries = fill(log, 6)
    forged = dataclasses.replace(entries[2], verdict="deny")
    forged = dataclasses.replace(forged, hash=forged.compute_hash())
    tamper(
        db_path,
        f"UPDATE audit_log SET verdict = 'deny', hash = '{forged.hash}' WHERE seq = 3",
    )
    result = log.verify()
    assert result.first_bad_seq == 4
    assert "hash of entry 3" in result.reason


def test_truncation_is_caught_by_a_recorded_head(log: AuditLog, db_path: Path) -> None:
    fill(log, 6)
    head = log.head()
    tamper(db_path, "DELETE FROM audit_log WHERE seq >= 5")
    assert log.verify().ok  # the chain alone cannot see a cut tail
    result = log.verify(expect_head=head)
    assert not result.ok
    assert result.first_bad_seq == 6


def test_invalid_appends_write_nothing(log: AuditLog) -> None:
    fill(log, 1)
    bad_calls: list[dict[str, Any]] = [
        {"verdict": "maybe"},
        {"job": "Bad Job"},
        {"region": "../x"},
        {"round": -1},
        {"round": True},
        {"details": {"x": math.nan}},
        {"details": {"x": object()}},
        {"actor": ""},
        {"actor": "line\nbreak"},
        {"action": ""},
    ]
    for overrides in bad_calls:
        kwargs: dict[str, Any] = {"actor": OPERATOR, "action": "job.create", "verdict": "ok"}
        kwargs.update(overrides)
        with pytest.raises(InvalidAuditEntry):
            log.append(AuditEvent(**kwargs))
    assert log.head()[0] == 1
    assert log.verify().ok


def test_append_joins_an_open_transaction(db_path: Path) -> None:
    conn = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    audit = AuditLog(conn, clock=Clock())
    audit.ensure_schema()
    conn.execute("CREATE TABLE state (k TEXT PRIMARY KEY, v TEXT)")
    audit.append(AuditEvent(OPERATOR, "job.create", "ok", job="job-a"))

    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO state VALUES ('round', '7')")
    audit.append(AuditEvent(OPERATOR, "round.publish", "ok", job="job-a", round=7))
    conn.execute("ROLLBACK")  # the state change fails, so its audit entry goes too
    assert conn.execute("SELECT count(*) FROM state").fetchone()[0] == 0
    assert audit.head()[0] == 1

    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO state VALUES ('round', '7')")
    entry = audit.append(AuditEvent(OPERATOR, "round.publish", "ok", round=7))
    conn.execute("COMMIT")
    assert entry.seq == 2
    assert audit.verify().ok
    conn.close()


def test_rejects_a_connection_with_implicit_transactions(db_path: Path) -> None:
    conn = sqlite3.connect(db_path)
    try:
        with pytest.raises(ValueError, match="isolation_level=None"):
            AuditLog(conn)
    finally:
        conn.close()


def test_reopened_log_continues_the_chain(db_path: Path) -> None:
    first = AuditLog.open(db_path, clock=Clock())
    entries = fill(first, 3)
    first.close()
    second = AuditLog.open(db_path, clock=Clock())
    try:
        assert second.entries() == entries
        nxt = second.append(AuditEvent(REGION, "delta.accept", AuditVerdict.ALLOW))
        assert (nxt.seq, nxt.prev_hash) == (4, entries[-1].hash)
        assert second.verify().ok
    finally:
        second.close()


def test_canonical_json_and_time_format() -> None:
    assert canonical_json({"b": 1, "a": [1, "é"]}) == '{"a":[1,"é"],"b":1}'.encode()
    with pytest.raises(ValueError, match="Out of range"):
        canonical_json({"x": math.inf})
    assert format_time(0.25) == "1970-01-01T00:00:00.250000Z"


def make_chain(n: int) -> list[AuditEntry]:
    entries: list[AuditEntry] = []
    prev = GENESIS_HASH
    for i in range(1, n + 1):
        draft = AuditEntry(
            seq=i,
            time=format_time(1000.0 + i),
            actor="spiffe://fed/region/eu-west",
            action="delta.accept",
            verdict="ok",
            job="job-a",
            round=i,
            region="eu-west",
            details={"i": i},
            prev_hash=prev,
            hash="",
        )
        entry = dataclasses.replace(draft, hash=draft.compute_hash())
        entries.append(entry)
        prev = entry.hash
    return entries


_MUTATIONS: dict[str, Any] = {
    "time": "2000-01-01T00:00:00.000000Z",
    "actor": "spiffe://fed/region/mallory",
    "action": "delta.reject",
    "verdict": "deny",
    "job": "job-z",
    "round": 10_000,
    "region": "us-east",
    "details": {"i": -1},
}


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=12),
    data=st.data(),
    field=st.sampled_from(sorted(_MUTATIONS)),
)
def test_any_single_field_change_is_pinpointed(n: int, data: st.DataObject, field: str) -> None:
    entries = make_chain(n)
    assert verify_chain(entries).ok
    victim = data.draw(st.integers(min_value=0, max_value=n - 1))
    entries[victim] = dataclasses.replace(entries[victim], **{field: _MUTATIONS[field]})
    result = verify_chain(entries)
    assert not result.ok
    assert result.first_bad_seq == victim + 1
    assert result.checked == victim
