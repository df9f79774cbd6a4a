"""Append-only, hash-chained audit log.

Every decision the coordinator makes about identity, residency and artifacts is one
entry, appended as an :class:`AuditEvent`. Each entry carries the hash of the one before
it (``prev_hash``) and its own ``hash = sha256(canonical JSON of the entry, prev_hash
included)``, so altering or deleting any row breaks the chain at that point.
:func:`verify_chain` is pure and checks entries from anywhere (the database, or what
``GET /v1/audit`` returned).

:class:`AuditLog` keeps the log in a SQLite table. Given the coordinator state
database's connection, an append joins the transaction that is already open there, so
the entry commits together with the state change it records; opened on its own
(:meth:`AuditLog.open`) it runs its own transactions. Triggers refuse UPDATE and DELETE.
Truncating the newest entries is not detectable from the chain alone: keep
:meth:`AuditLog.head` somewhere else and pass it to :func:`verify_chain` later.
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from geofed.types import Identity, InvalidName, validate_name

GENESIS_HASH = "0" * 64
MAX_PAGE = 1000
_MAX_ACTOR_LEN = 512


class AuditError(Exception):
    """Base class of audit log errors."""


class InvalidAuditEntry(AuditError, ValueError):
    """An entry to append (or one received from elsewhere) is malformed."""


class AuditVerdict(StrEnum):
    """Outcome recorded with an action: a decision (allow/deny) or an operation (ok/error)."""

    ALLOW = "allow"
    DENY = "deny"
    OK = "ok"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class AuditEvent:
    """What one entry records, before the log numbers, times and chains it.

    ``actor`` is who acted (an identity, or a description such as an unverified peer);
    ``job``/``round``/``region`` name the subject, where it has one. The log checks the
    fields when the event is appended (:class:`InvalidAuditEntry`).
    """

    actor: str | Identity
    action: str
    verdict: AuditVerdict | str
    job: str | None = None
    round: int | None = None
    region: str | None = None
    details: Mapping[str, Any] | None = field(default=None, hash=False)


def canonical_json(value: Any) -> bytes:
    """Deterministic JSON: sorted keys, no spaces, UTF-8, NaN/Infinity refused."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def format_time(epoch_s: float) -> str:
    """RFC 3339 UTC with microseconds, the entry time format."""
    return datetime.fromtimestamp(epoch_s, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def entry_time(text: str) -> float:
    """An entry's time (:func:`format_time`'s format) as epoch seconds; NaN if unreadable."""
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return math.nan


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One audit record. ``round``/``job``/``region`` name its subject, where it has one."""

    seq: int
    time: str
    actor: str
    action: str
    verdict: str
    job: str | None
    round: int | None
    region: str | None
    details: Mapping[str, Any] = field(hash=False)
    prev_hash: str
    hash: str

    def hashed_fields(self) -> dict[str, Any]:
        """Everything the entry's hash covers."""
        return {
            "seq": self.seq,
            "time": self.time,
            "actor": self.actor,
            "action": self.action,
            "verdict": self.verdict,
            "job": self.job,
            "round": self.round,
            "region": self.region,
            "details": self.details,
            "prev_hash": self.prev_hash,
        }

    def compute_hash(self) -> str:
        return hashlib.sha256(canonical_json(self.hashed_fields())).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        """JSON form, as served by ``GET /v1/audit``."""
        return {**self.hashed_fields(), "details": dict(self.details), "hash": self.hash}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AuditEntry:
        """Parse the JSON form; raise InvalidAuditEntry naming the bad field."""

        def get(name: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
            if name not in data:
                raise InvalidAuditEntry(f"audit entry lacks field {name!r}")
            value = data[name]
            if value is None and optional:
                return None
            if not isinstance(value, kind) or isinstance(value, bool):
                raise InvalidAuditEntry(f"audit entry field {name!r} has a wrong type: {value!r}")
            return value

        return cls(
            seq=get("seq", int),
            time=get("time", str),
            actor=get("actor", str),
            action=get("action", str),
            verdict=get("verdict", str),
            job=get("job", str, optional=True),
            round=get("round", int, optional=True),
            region=get("region", str, optional=True),
            details=get("details", dict),
            prev_hash=get("prev_hash", str),
            hash=get("hash", str),
        )


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """Outcome of a chain check. ``first_bad_seq`` pinpoints where the chain breaks."""

    ok: bool
    checked: int
    first_bad_seq: int | None = None
    reason: str = ""
    head_seq: int = 0
    head_hash: str = GENESIS_HASH


def verify_chain(
    entries: Iterable[AuditEntry],
    *,
    prev_hash: str | None = None,
    start_seq: int | None = None,
    expect_head: tuple[int, str] | None = None,
) -> VerifyResult:
    """Check that ``entries`` (ascending seq) form an unbroken chain.

    ``prev_hash`` is the hash of the entry before the first one; when omitted it is the
    genesis hash if the first entry is seq 1, and trusted as given otherwise (a page
    from the middle of the log). ``start_seq`` is the seq the first entry must have
    (1 for a whole log). ``expect_head`` (seq, hash), recorded earlier, must
    appear in the entries: this detects a log truncated after that point.
    """
    expected_prev = prev_hash
    last_seq: int | None = None
    head_seq, head_hash = 0, GENESIS_HASH
    checked = 0
    head_seen = expect_head is None or expect_head[0] == 0

    def bad(seq: int, reason: str) -> VerifyResult:
        return VerifyResult(False, checked, seq, reason, head_seq, head_hash)

    for entry in entries:
        if last_seq is None and start_seq is not None and entry.seq != start_seq:
            return bad(start_seq, f"entry {start_seq} is missing (first is {entry.seq})")
        if last_seq is not None and entry.seq != last_seq + 1:
            return bad(last_seq + 1, f"entry {last_seq + 1} is missing (next is {entry.seq})")
        if expected_prev is None and entry.seq == 1:
            expected_prev = GENESIS_HASH
        if expected_prev is not None and entry.prev_hash != expected_prev:
            where = "the genesis hash" if entry.seq == 1 else f"the hash of entry {entry.seq - 1}"
            return bad(entry.seq, f"entry {entry.seq}: prev_hash does not match {where}")
        try:
            actual = entry.compute_hash()
        except (TypeError, ValueError) as exc:
            return bad(entry.seq, f"entry {entry.seq}: content cannot be hashed: {exc}")
        if actual != entry.hash:
            return bad(entry.seq, f"entry {entry.seq}: content does not match its hash")
        checked += 1
        expected_prev = entry.hash
        last_seq = entry.seq
        head_seq, head_hash = entry.seq, entry.hash
        if expect_head is not None and (entry.seq, entry.hash) == expect_head:
            head_seen = True
    if expect_head is not None and not head_seen:
        return bad(expect_head[0], f"entry {expect_head[0]} with the recorded hash is gone")
    return VerifyResult(True, checked, None, "", head_seq, head_hash)


SCHEMA_STATEMENTS: tuple[str, ...] = (
    """CREATE TABLE IF NOT EXISTS audit_log (
        seq INTEGER PRIMARY KEY,
        time TEXT NOT NULL,
        actor TEXT NOT NULL,
        action TEXT NOT NULL,
        verdict TEXT NOT NULL,
        job TEXT,
        round INTEGER,
        region TEXT,
        details TEXT NOT NULL,
        prev_hash TEXT NOT NULL,
        hash TEXT NOT NULL UNIQUE
    )""",
    "CREATE INDEX IF NOT EXISTS audit_log_job ON audit_log (job, seq)",
    """CREATE TRIGGER IF NOT EXISTS audit_log_no_update BEFORE UPDATE ON audit_log
        BEGIN SELECT RAISE(ABORT, 'audit_log is append-only'); END""",
    """CREATE TRIGGER IF NOT EXISTS audit_log_no_delete BEFORE DELETE ON audit_log
        BEGIN SELECT RAISE(ABORT, 'audit_log is append-only'); END""",
)
"""DDL of the audit table; the state store's schema migrations include it."""

#: The audit table's columns, in the order :func:`entry_row` gives them.
AUDIT_COLUMNS = "seq, time, actor, action, verdict, job, round, region, details, prev_hash, hash"


class AuditLog:
    """The audit log in a SQLite table (blocking; call it from one worker thread).

    ``conn`` must be in autocommit mode (``isolation_level=None``); ``lock`` is shared
    with whoever else uses the connection.
    """

    def __init__(
        self,
        conn: sqlite3.Connection,
        *,
        lock: threading.RLock | None = None,
        clock: Callable[[], float] = time.time,
        owns_connection: bool = False,
    ) -> None:
        if conn.isolation_level is not None:
            raise ValueError("AuditLog needs a connection opened with isolation_level=None")
        self._conn = conn
        self._lock = lock if lock is not None else threading.RLock()
        self._clock = clock
        self._owns_connection = owns_connection

    @classmethod
    def open(cls, path: str | Path, *, clock: Callable[[], float] = time.time) -> AuditLog:
        """A standalone log in its own SQLite file (WAL, synchronous=FULL)."""
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            log = cls(conn, clock=clock, owns_connection=True)
            log.ensure_schema()
        except BaseException:
            conn.close()
            raise
        return log

    def ensure_schema(self) -> None:
        """Create the table and triggers if they are missing."""
        with self._lock, self._transaction():
            for statement in SCHEMA_STATEMENTS:
                self._conn.execute(statement)

    def close(self) -> None:
        if self._owns_connection:
            with self._lock:
                self._conn.close()

    def append(self, event: AuditEvent) -> AuditEntry:
        """Append one entry and return it (in the open transaction, if there is one)."""
        fields = validated_fields(event)
        with self._lock, self._transaction():
            row = self._conn.execute(
                "SELECT seq, hash FROM audit_log ORDER BY seq DESC LIMIT 1"
            ).fetchone()
            seq, prev_hash = (row[0] + 1, row[1]) if row else (1, GENESIS_HASH)
            entry = chained_entry(fields, seq, prev_hash, self._clock())
            self._conn.execute(
                f"INSERT INTO audit_log ({AUDIT_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?)",  # noqa: S608
                entry_row(entry),
            )
        return entry

    def entries(
        self, after_seq: int = 0, limit: int = 100, job: str | None = None
    ) -> list[AuditEntry]:
        """Entries with seq > ``after_seq``, ascending, at most ``limit`` (1..1000)."""
        if not 1 <= limit <= MAX_PAGE:
            raise ValueError(f"limit must be 1..{MAX_PAGE}, got {limit}")
        if after_seq < 0:
            raise ValueError(f"after_seq must be >= 0, got {after_seq}")
        query = f"SELECT {AUDIT_COLUMNS} FROM audit_log WHERE seq > ?"  # noqa: S608
        params: list[Any] = [after_seq]
        if job is not None:
            query += " AND job = ?"
            params.append(validate_name("job", job))
        query += " ORDER BY seq LIMIT ?"
        params.append(limit)
        with self._lock:
            rows = self._conn.execute(query, params).fetchall()
        return [entry_from_row(row) for row in rows]

    def head(self) -> tuple[int, str]:
        """(seq, hash) of the newest entry; (0, genesis hash) when empty."""
        with self._lock:
            row = self._conn.execute(
                "SELECT seq, hash FROM audit_log ORDER BY seq DESC LIMIT 1"
            ).fetchone()
        return (int(row[0]), str(row[1])) if row else (0, GENESIS_HASH)

    def verify(self, *, expect_head: tuple[int, str] | None = None) -> VerifyResult:
        """Check the whole stored chain from seq 1; see :func:`verify_chain`."""
        with self._lock:
            cursor = self._conn.execute(f"SELECT {AUDIT_COLUMNS} FROM audit_log ORDER BY seq")  # noqa: S608
            return verify_chain(
                rows_as_entries(cursor),
                prev_hash=GENESIS_HASH,
                start_seq=1,
                expect_head=expect_head,
            )

    def _transaction(self) -> _Tx:
        return _Tx(self._conn)


class _Tx:
    """Join the connection's open transaction, or run a BEGIN IMMEDIATE one."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._own = False

    def __enter__(self) -> None:
        if not self._conn.in_transaction:
            self._conn.execute("BEGIN IMMEDIATE")
            self._own = True

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if not self._own:
            return
        self._conn.execute("ROLLBACK" if exc_type is not None else "COMMIT")


def validated_fields(event: AuditEvent) -> dict[str, Any]:
    """An event's fields as an entry stores them; :class:`InvalidAuditEntry` otherwise."""
    actor, action, verdict = event.actor, event.action, event.verdict
    round_, details = event.round, event.details
    actor_s = actor.uri if isinstance(actor, Identity) else actor
    if not isinstance(actor_s, str) or not actor_s or len(actor_s) > _MAX_ACTOR_LEN:
        raise InvalidAuditEntry(f"actor must be a non-empty string (identity URI): {actor!r}")
    if not actor_s.isprintable():
        raise InvalidAuditEntry(f"actor contains control characters: {actor_s!r}")
    if not isinstance(action, str) or not action or len(action) > 64 or not action.isascii():
        raise InvalidAuditEntry(
            f"action must be a short ASCII word like 'delta.accept': {action!r}"
        )
    try:
        verdict_v = AuditVerdict(verdict)
    except ValueError:
        allowed = ", ".join(v.value for v in AuditVerdict)
        raise InvalidAuditEntry(f"verdict must be one of {allowed}: {verdict!r}") from None
    try:
        if event.job is not None:
            validate_name("job", event.job)
        if event.region is not None:
            validate_name("region", event.region)
    except InvalidName as exc:
        raise InvalidAuditEntry(str(exc)) from None
    if round_ is not None and (
        not isinstance(round_, int) or isinstance(round_, bool) or round_ < 0
    ):
        raise InvalidAuditEntry(f"round must be a non-negative integer: {round_!r}")
    try:
        # Round-trip so the stored, hashed and returned forms are the same value.
        details_d = json.loads(canonical_json(dict(details) if details is not None else {}))
    except (TypeError, ValueError) as exc:
        raise InvalidAuditEntry(f"details must be JSON (no NaN/Infinity): {exc}") from None
    return {
        "actor": actor_s,
        "action": action,
        "verdict": verdict_v.value,
        "job": event.job,
        "round": round_,
        "region": event.region,
        "details": details_d,
    }


def chained_entry(fields: Mapping[str, Any], seq: int, prev_hash: str, now: float) -> AuditEntry:
    """The entry number ``seq`` after the entry hashed ``prev_hash``, with its own hash.

    ``fields`` come from :func:`validated_fields`; every store appends entries made here.
    """
    draft = AuditEntry(seq=seq, time=format_time(now), prev_hash=prev_hash, hash="", **fields)
    return AuditEntry(**{**draft.hashed_fields(), "hash": draft.compute_hash()})


def entry_row(entry: AuditEntry) -> tuple[Any, ...]:
    """An entry as the audit table's row (:data:`AUDIT_COLUMNS`)."""
    return (
        entry.seq,
        entry.time,
        entry.actor,
        entry.action,
        entry.verdict,
        entry.job,
        entry.round,
        entry.region,
        canonical_json(entry.details).decode("utf-8"),
        entry.prev_hash,
        entry.hash,
    )


def entry_from_row(row: tuple[Any, ...]) -> AuditEntry:
    """An audit table row (:data:`AUDIT_COLUMNS`) as its entry."""
    seq, time_s, actor, action, verdict, job, round_, region, details, prev_hash, hash_ = row
    return AuditEntry(
        seq=seq,
        time=time_s,
        actor=actor,
        action=action,
        verdict=verdict,
        job=job,
        round=round_,
        region=region,
        details=json.loads(details),
        prev_hash=prev_hash,
        hash=hash_,
    )


def rows_as_entries(rows: Iterable[tuple[Any, ...]]) -> Iterator[AuditEntry]:
    """Rows as entries; a row whose details no longer parse yields an unhashable stand-in."""
    for row in rows:
        try:
            yield entry_from_row(row)
        except ValueError:
            yield AuditEntry(
                seq=row[0],
                time=row[1],
                actor=row[2],
                action=row[3],
                verdict=row[4],
                job=row[5],
                round=row[6],
                region=row[7],
                details={"<unparseable>": row[8]},
                prev_hash=row[9],
                hash="",
            )
