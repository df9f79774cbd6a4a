"""The SQLite implementation of the coordinator's :class:`~coordinator.state.store.Store`.

The store's rules are :class:`coordinator.state.sql.SqlStore`'s; this module is the
connection, its transactions, the schema and the audit log
(:class:`~coordinator.state.audit.AuditLog`).

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

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from coordinator.state import audit
from coordinator.state.audit import (
    AuditEntry,
    AuditEvent,
    AuditLog,
    InvalidAuditEntry,
    VerifyResult,
)
from coordinator.state.sql import SqlStore, SqlTypes, core_schema
from coordinator.state.store import (
    InvalidValue,
    SchemaError,
    StoreClosed,
    StoreFailure,
)

DB_FILENAME = "coordinator.db"

_SCHEMA_V1: tuple[str, ...] = (
    *core_schema(SqlTypes(integer="INTEGER", real="REAL")),
    *audit.SCHEMA_STATEMENTS,
)

MIGRATIONS: tuple[tuple[int, tuple[str, ...]], ...] = ((1, _SCHEMA_V1),)
"""(version, statements) in ascending order; append a new entry to change the schema."""
SCHEMA_VERSION = MIGRATIONS[-1][0]


class SqliteStore(SqlStore):
    """Coordinator state in one SQLite file. See the module docstring for threading."""

    _JOB_ORDER = "rowid"
    _DB_ERROR = sqlite3.Error

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
            with self._begun(savepoint, f"RELEASE {savepoint}", str(self._path)):
                yield

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

    def _execute(self, query: str, params: Sequence[Any]) -> int:
        return int(self._conn.execute(query, params).rowcount)

    def _one(self, query: str, params: Sequence[Any]) -> tuple[Any, ...] | None:
        with self._reading():
            row: tuple[Any, ...] | None = self._conn.execute(query, params).fetchone()
        return row

    def _all(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        with self._reading():
            rows: list[tuple[Any, ...]] = self._conn.execute(query, params).fetchall()
        return rows

    def __repr__(self) -> str:
        return f"SqliteStore({str(self._path)!r})"


def _create_private(path: Path) -> None:
    """Create the database file 0600 if it does not exist; SQLite's -wal/-shm copy its mode."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return
    except OSError as exc:
        raise StoreFailure(f"cannot create state database {path}: {exc}") from exc
    os.close(fd)
