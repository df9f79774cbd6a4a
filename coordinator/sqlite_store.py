"""The SQLite implementation of the coordinator's :class:`~coordinator.store.Store`.

One database file in the coordinator's state directory, in WAL mode with
``synchronous=FULL``: a write is on disk when its call (or its outermost transaction)
returns, so a delta is acknowledged only once it is durable, and a process killed
mid-transaction leaves the last committed state. Foreign keys are on; the schema is
versioned in ``schema_migrations`` and upgraded by :data:`MIGRATIONS` when opened.

Blocking by design. The daemon calls it from one dedicated worker thread (an executor
with one thread); the connection is opened with ``check_same_thread=False`` and every
call holds a re-entrant lock, so that thread need not be the one that created the store.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from coordinator import audit
from coordinator.audit import AuditEntry, AuditEvent, AuditLog, InvalidAuditEntry, VerifyResult
from coordinator.store import (
    AlreadyExists,
    ConflictError,
    InvalidValue,
    JobRecord,
    MissingRecord,
    Receipt,
    SchemaError,
    StoreClosed,
    StoredRound,
    StoreFailure,
    check_count,
    check_digest,
    check_job_id,
    check_pointer,
    check_pointer_name,
    check_region,
    check_round,
    check_state,
    to_json,
)

DB_FILENAME = "coordinator.db"

_SCHEMA_V1: tuple[str, ...] = (
    """CREATE TABLE jobs (
        job_id TEXT PRIMARY KEY,
        spec TEXT NOT NULL,
        state TEXT NOT NULL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL)""",
    """CREATE TABLE rounds (
        job_id TEXT NOT NULL REFERENCES jobs (job_id),
        round INTEGER NOT NULL CHECK (round >= 0),
        state TEXT NOT NULL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (job_id, round))""",
    """CREATE TABLE receipts (
        job_id TEXT NOT NULL REFERENCES jobs (job_id),
        round INTEGER NOT NULL CHECK (round >= 0),
        region TEXT NOT NULL,
        manifest_digest TEXT NOT NULL,
        blob_digest TEXT NOT NULL,
        size INTEGER NOT NULL CHECK (size >= 0),
        tokens INTEGER NOT NULL CHECK (tokens >= 0),
        received_at REAL NOT NULL,
        PRIMARY KEY (job_id, round, region))""",
    """CREATE TABLE upload_chunks (
        job_id TEXT NOT NULL REFERENCES jobs (job_id),
        round INTEGER NOT NULL,
        region TEXT NOT NULL,
        manifest_digest TEXT NOT NULL,
        chunk_index INTEGER NOT NULL CHECK (chunk_index >= 0),
        digest TEXT NOT NULL,
        size INTEGER NOT NULL CHECK (size >= 0),
        PRIMARY KEY (job_id, round, region, manifest_digest, chunk_index))""",
    """CREATE TABLE pointers (
        job_id TEXT NOT NULL REFERENCES jobs (job_id),
        name TEXT NOT NULL,
        value TEXT NOT NULL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (job_id, name))""",
    *audit.SCHEMA_STATEMENTS,
)

MIGRATIONS: tuple[tuple[int, tuple[str, ...]], ...] = ((1, _SCHEMA_V1),)
"""(version, statements) in ascending order; append a new entry to change the schema."""
SCHEMA_VERSION = MIGRATIONS[-1][0]

_RECEIPT_COLUMNS = "job_id, round, region, manifest_digest, blob_digest, size, tokens, received_at"


class SqliteStore:
    """Coordinator state in one SQLite file. See the module docstring for threading."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: Callable[[], float] = time.time,
        busy_timeout_s: float = 10.0,
    ) -> None:
        self._path = Path(path)
        self._clock = clock
        self._lock = threading.RLock()
        self._depth = 0
        self._closed = False
        _create_private(self._path)
        try:
            self._conn = sqlite3.connect(
                self._path, isolation_level=None, check_same_thread=False, timeout=busy_timeout_s
            )
        except sqlite3.Error as exc:
            raise StoreFailure(f"cannot open state database {self._path}: {exc}") from exc
        try:
            self._configure(busy_timeout_s)
            self._audit = AuditLog(self._conn, lock=self._lock, clock=clock)
            self._migrate()
        except BaseException:
            self._conn.close()
            raise

    @classmethod
    def in_state_dir(cls, state_dir: str | os.PathLike[str], **kwargs: Any) -> SqliteStore:
        """Open (creating if needed) ``<state_dir>/coordinator.db``."""
        directory = Path(state_dir)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        return cls(directory / DB_FILENAME, **kwargs)

    @property
    def path(self) -> Path:
        return self._path

    def schema_version(self) -> int:
        with self._reading():
            row = self._conn.execute("SELECT max(version) FROM schema_migrations").fetchone()
        return int(row[0] or 0)

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self._lock:
            self._check_open()
            savepoint = f"sp{self._depth}" if self._depth else None
            try:
                self._conn.execute(f"SAVEPOINT {savepoint}" if savepoint else "BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StoreFailure(f"cannot begin a transaction on {self._path}: {exc}") from exc
            self._depth += 1
            try:
                yield
            except BaseException as exc:
                self._depth -= 1
                self._undo(savepoint)
                if isinstance(exc, sqlite3.Error):
                    raise StoreFailure(f"state database {self._path}: {exc}") from exc
                raise
            self._depth -= 1
            try:
                self._conn.execute(f"RELEASE {savepoint}" if savepoint else "COMMIT")
            except sqlite3.Error as exc:
                self._undo(savepoint)
                raise StoreFailure(f"commit failed on {self._path}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._depth:
                raise StoreFailure("cannot close the store inside a transaction")
            self._closed = True
            self._conn.close()

    # Jobs.

    def create_job(self, job_id: str, spec: Mapping[str, Any], state: str) -> JobRecord:
        check_job_id(job_id)
        spec_json = to_json("job spec", spec)
        check_state(state)
        with self.transaction():
            if self._job_exists(job_id):
                raise AlreadyExists(f"job {job_id!r} already exists")
            now = self._clock()
            self._conn.execute(
                "INSERT INTO jobs (job_id, spec, state, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (job_id, spec_json, state, now, now),
            )
        return JobRecord(job_id, json.loads(spec_json), state, now, now)

    def get_job(self, job_id: str) -> JobRecord | None:
        check_job_id(job_id)
        with self._reading():
            row = self._conn.execute(
                "SELECT job_id, spec, state, created_at, updated_at FROM jobs WHERE job_id = ?",
                (job_id,),
            ).fetchone()
        return _job(row) if row else None

    def list_jobs(self, state: str | None = None) -> list[JobRecord]:
        query = "SELECT job_id, spec, state, created_at, updated_at FROM jobs"
        params: tuple[str, ...] = ()
        if state is not None:
            query += " WHERE state = ?"
            params = (check_state(state),)
        with self._reading():
            rows = self._conn.execute(query + " ORDER BY rowid", params).fetchall()
        return [_job(row) for row in rows]

    def set_job_state(self, job_id: str, state: str, *, expected: str | None = None) -> JobRecord:
        check_job_id(job_id)
        check_state(state)
        if expected is not None:
            check_state(expected)
        with self.transaction():
            job = self.get_job(job_id)
            if job is None:
                raise MissingRecord(f"no job {job_id!r}")
            if expected is not None and job.state != expected:
                raise ConflictError(f"job {job_id!r} is {job.state!r}, not {expected!r}")
            now = self._clock()
            self._conn.execute(
                "UPDATE jobs SET state = ?, updated_at = ? WHERE job_id = ?", (state, now, job_id)
            )
        return JobRecord(job_id, job.spec, state, job.created_at, now)

    # Rounds.

    def save_round(self, job_id: str, round: int, state: Mapping[str, Any]) -> StoredRound:
        check_job_id(job_id)
        check_round(round)
        state_json = to_json("round state", state)
        with self.transaction():
            self._require_job(job_id)
            now = self._clock()
            self._conn.execute(
                "INSERT INTO rounds (job_id, round, state, updated_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (job_id, round)"
                " DO UPDATE SET state = excluded.state, updated_at = excluded.updated_at",
                (job_id, round, state_json, now),
            )
        return StoredRound(job_id, round, json.loads(state_json), now)

    def load_round(self, job_id: str, round: int) -> StoredRound | None:
        check_job_id(job_id)
        check_round(round)
        return self._one_round("WHERE job_id = ? AND round = ?", (job_id, round))

    def latest_round(self, job_id: str) -> StoredRound | None:
        check_job_id(job_id)
        return self._one_round("WHERE job_id = ? ORDER BY round DESC LIMIT 1", (job_id,))

    # Delta receipts.

    def record_receipt(
        self,
        job_id: str,
        round: int,
        region: str,
        manifest_digest: str,
        blob_digest: str,
        size: int,
        tokens: int,
    ) -> Receipt:
        check_job_id(job_id)
        check_round(round)
        check_region(region)
        check_digest("manifest digest", manifest_digest)
        check_digest("blob digest", blob_digest)
        check_count("size", size)
        check_count("tokens", tokens)
        key = (job_id, round, region)
        with self.transaction():
            self._require_job(job_id)
            row = self._conn.execute(
                f"SELECT {_RECEIPT_COLUMNS} FROM receipts"  # noqa: S608
                " WHERE job_id = ? AND round = ? AND region = ?",
                key,
            ).fetchone()
            receipt = Receipt(*key, manifest_digest, blob_digest, size, tokens, self._clock())
            if row is not None:
                existing = Receipt(*row)
                if existing.same_delta(receipt):
                    return existing
                raise ConflictError(
                    f"region {region!r} already has a different delta accepted for job"
                    f" {job_id!r} round {round} (manifest {existing.manifest_digest})"
                )
            self._conn.execute(
                f"INSERT INTO receipts ({_RECEIPT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",  # noqa: S608
                (*key, manifest_digest, blob_digest, size, tokens, receipt.received_at),
            )
        return receipt

    def list_receipts(self, job_id: str, round: int) -> list[Receipt]:
        check_job_id(job_id)
        check_round(round)
        with self._reading():
            rows = self._conn.execute(
                f"SELECT {_RECEIPT_COLUMNS} FROM receipts"  # noqa: S608
                " WHERE job_id = ? AND round = ? ORDER BY region",
                (job_id, round),
            ).fetchall()
        return [Receipt(*row) for row in rows]

    # Resumable upload progress.

    def record_upload_chunk(
        self,
        job_id: str,
        round: int,
        region: str,
        manifest_digest: str,
        index: int,
        digest: str,
        size: int,
    ) -> None:
        key = _upload_key(job_id, round, region, manifest_digest)
        check_count("chunk index", index)
        check_digest("chunk digest", digest)
        check_count("chunk size", size)
        with self.transaction():
            self._require_job(job_id)
            row = self._conn.execute(
                "SELECT digest, size FROM upload_chunks WHERE job_id = ? AND round = ?"
                " AND region = ? AND manifest_digest = ? AND chunk_index = ?",
                (*key, index),
            ).fetchone()
            if row is not None:
                if (row[0], row[1]) == (digest, size):
                    return
                raise ConflictError(
                    f"chunk {index} of upload {manifest_digest} (job {job_id!r} round {round}"
                    f" region {region!r}) was already received with digest {row[0]}"
                )
            self._conn.execute(
                "INSERT INTO upload_chunks (job_id, round, region, manifest_digest, chunk_index,"
                " digest, size) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (*key, index, digest, size),
            )

    def uploaded_chunks(
        self, job_id: str, round: int, region: str, manifest_digest: str
    ) -> dict[int, str]:
        key = _upload_key(job_id, round, region, manifest_digest)
        with self._reading():
            rows = self._conn.execute(
                "SELECT chunk_index, digest FROM upload_chunks WHERE job_id = ? AND round = ?"
                " AND region = ? AND manifest_digest = ? ORDER BY chunk_index",
                key,
            ).fetchall()
        return {int(index): str(digest) for index, digest in rows}

    def clear_upload(
        self, job_id: str, round: int, region: str, manifest_digest: str | None = None
    ) -> int:
        check_job_id(job_id)
        check_round(round)
        check_region(region)
        query = "DELETE FROM upload_chunks WHERE job_id = ? AND round = ? AND region = ?"
        params: tuple[object, ...] = (job_id, round, region)
        if manifest_digest is not None:
            query += " AND manifest_digest = ?"
            params += (check_digest("manifest digest", manifest_digest),)
        with self.transaction():
            return self._conn.execute(query, params).rowcount

    # Per-job pointers.

    def set_pointer(self, job_id: str, name: str, value: str) -> None:
        check_job_id(job_id)
        check_pointer(name, value)
        with self.transaction():
            self._require_job(job_id)
            self._conn.execute(
                "INSERT INTO pointers (job_id, name, value, updated_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (job_id, name)"
                " DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at",
                (job_id, name, value, self._clock()),
            )

    def get_pointer(self, job_id: str, name: str) -> str | None:
        check_job_id(job_id)
        check_pointer_name(name)
        with self._reading():
            row = self._conn.execute(
                "SELECT value FROM pointers WHERE job_id = ? AND name = ?", (job_id, name)
            ).fetchone()
        return str(row[0]) if row else None

    def list_pointers(self, job_id: str) -> dict[str, str]:
        check_job_id(job_id)
        with self._reading():
            rows = self._conn.execute(
                "SELECT name, value FROM pointers WHERE job_id = ? ORDER BY name", (job_id,)
            ).fetchall()
        return {str(name): str(value) for name, value in rows}

    # Audit log.

    def append_audit(self, event: AuditEvent) -> AuditEntry:
        with self.transaction():
            try:
                return self._audit.append(event)
            except InvalidAuditEntry as exc:
                raise InvalidValue(str(exc)) from None

    def audit_entries(
        self, after_seq: int = 0, limit: int = 100, job: str | None = None
    ) -> list[AuditEntry]:
        with self._reading():
            try:
                return self._audit.entries(after_seq, limit, job)
            except ValueError as exc:
                raise InvalidValue(str(exc)) from None

    def audit_head(self) -> tuple[int, str]:
        with self._reading():
            return self._audit.head()

    def verify_audit(self, *, expect_head: tuple[int, str] | None = None) -> VerifyResult:
        with self._reading():
            return self._audit.verify(expect_head=expect_head)

    # Internals.

    def _configure(self, busy_timeout_s: float) -> None:
        mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StoreFailure(f"{self._path}: cannot switch to WAL mode (got {mode!r})")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        self._conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")

    def _migrate(self) -> None:
        with self.transaction():
            self._conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations"
                " (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)"
            )
            current = self._conn.execute("SELECT max(version) FROM schema_migrations").fetchone()
            current_version = int(current[0] or 0)
            if current_version > SCHEMA_VERSION:
                raise SchemaError(
                    f"{self._path} has schema version {current_version}; this coordinator"
                    f" knows up to {SCHEMA_VERSION}: upgrade the coordinator"
                )
            for version, statements in MIGRATIONS:
                if version <= current_version:
                    continue
                for statement in statements:
                    self._conn.execute(statement)
                self._conn.execute(
                    "INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)",
                    (version, self._clock()),
                )

    @contextmanager
    def _reading(self) -> Iterator[None]:
        with self._lock:
            self._check_open()
            try:
                yield
            except sqlite3.Error as exc:
                raise StoreFailure(f"state database {self._path}: {exc}") from exc

    def _undo(self, savepoint: str | None) -> None:
        if savepoint:
            self._conn.execute(f"ROLLBACK TO {savepoint}")
            self._conn.execute(f"RELEASE {savepoint}")
        elif self._conn.in_transaction:
            self._conn.execute("ROLLBACK")

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"state store {self._path} is closed")

    def _job_exists(self, job_id: str) -> bool:
        row = self._conn.execute("SELECT 1 FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return row is not None

    def _require_job(self, job_id: str) -> None:
        if not self._job_exists(job_id):
            raise MissingRecord(f"no job {job_id!r}")

    def _one_round(self, where: str, params: tuple[object, ...]) -> StoredRound | None:
        with self._reading():
            row = self._conn.execute(
                f"SELECT job_id, round, state, updated_at FROM rounds {where}",  # noqa: S608
                params,
            ).fetchone()
        return StoredRound(row[0], row[1], json.loads(row[2]), row[3]) if row else None

    def __repr__(self) -> str:
        return f"SqliteStore({str(self._path)!r})"


def _job(row: tuple[Any, ...]) -> JobRecord:
    return JobRecord(row[0], json.loads(row[1]), row[2], row[3], row[4])


def _upload_key(
    job_id: str, round_: int, region: str, manifest_digest: str
) -> tuple[str, int, str, str]:
    return (
        check_job_id(job_id),
        check_round(round_),
        check_region(region),
        check_digest("manifest digest", manifest_digest),
    )


def _create_private(path: Path) -> None:
    """Create the database file 0600 if it does not exist; SQLite's -wal/-shm copy its mode."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return
    except OSError as exc:
        raise StoreFailure(f"cannot create state database {path}: {exc}") from exc
    os.close(fd)
