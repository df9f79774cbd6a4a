"""The PostgreSQL implementation of the coordinator's :class:`~coordinator.state.store.Store`.

For a coordinator whose state must outlive its machine: the same contract as
:mod:`coordinator.state.sqlite` and the same rules (:class:`coordinator.state.sql.SqlStore`;
the shared suite in ``tests/support/store_contract.py`` runs against both), on a
PostgreSQL server named by a connection string (``state_store``
in the coordinator config). A write is durable when its call, or its outermost
transaction, returns (PostgreSQL commits with ``synchronous_commit`` on, its default; a
server configured otherwise weakens that promise). The schema is versioned in
``geofed_schema_migrations`` and upgraded when the store is opened.

Writers are serialized across every process using the same database: each outermost
transaction first takes one transaction-scoped advisory lock
(:data:`WRITER_LOCK`), as SQLite's ``BEGIN IMMEDIATE`` does, so a check-then-write (a
receipt, an audit entry's place in the chain) cannot interleave with another
coordinator's. Nested transactions are savepoints.

Coordinators that share the database elect a leader (:mod:`coordinator.ha.postgres_lease`);
the leader's store is opened with its :class:`~coordinator.ha.lease.Fence`, and every
outermost transaction checks, under the writer lock, that the lease still carries the
fence's token: a deposed leader's writes fail with :class:`StoreFenced`, changing nothing.

Blocking by design, like the SQLite store: the daemon calls it from one worker thread,
every call holding a re-entrant lock. Needs ``psycopg`` 3 (``pip install
'geofed[postgres]'``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final

from coordinator.ha.lease import Fence
from coordinator.state.audit import (
    AUDIT_COLUMNS,
    GENESIS_HASH,
    MAX_PAGE,
    AuditEntry,
    AuditEvent,
    InvalidAuditEntry,
    VerifyResult,
    chained_entry,
    entry_from_row,
    entry_row,
    rows_as_entries,
    validated_fields,
    verify_chain,
)
from coordinator.state.sql import SqlStore, SqlTypes, core_schema
from coordinator.state.store import (
    InvalidValue,
    SchemaError,
    StoreClosed,
    StoreFailure,
)
from geofed.types import validate_name

try:  # an optional dependency: only a coordinator configured for PostgreSQL needs it
    import psycopg

    _MISSING = ""
    _DRIVER_ERROR: type[Exception] = psycopg.Error
except ImportError as _exc:  # pragma: no cover - exercised where psycopg is missing
    _MISSING = str(_exc)
    _DRIVER_ERROR = Exception  # never raised: the store cannot be opened without psycopg

__all__ = [
    "LEASE_TABLE",
    "SCHEMA_VERSION",
    "WRITER_LOCK",
    "PostgresStore",
    "StoreFenced",
    "describe_dsn",
]

#: The advisory lock every writing transaction takes (an arbitrary, fixed 64-bit key).
WRITER_LOCK: Final = 0x67656F666564  # "geofed"
#: The leader leases of coordinators sharing the database (:mod:`coordinator.ha.postgres_lease`).
LEASE_TABLE: Final = "geofed_leader_lease"


class StoreFenced(StoreFailure):
    """A write of a coordinator whose leader lease another coordinator has taken over."""


_SCHEMA_V1: tuple[str, ...] = (
    *core_schema(
        SqlTypes(integer="BIGINT", real="DOUBLE PRECISION", job_seq="seq BIGSERIAL UNIQUE")
    ),
    """CREATE TABLE audit_log (
        seq BIGINT PRIMARY KEY,
        time TEXT NOT NULL,
        actor TEXT NOT NULL,
        action TEXT NOT NULL,
        verdict TEXT NOT NULL,
        job TEXT,
        round BIGINT,
        region TEXT,
        details TEXT NOT NULL,
        prev_hash TEXT NOT NULL,
        hash TEXT NOT NULL UNIQUE)""",
    "CREATE INDEX audit_log_job ON audit_log (job, seq)",
    """CREATE FUNCTION geofed_audit_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN RAISE EXCEPTION 'audit_log is append-only'; END $$""",
    """CREATE TRIGGER audit_log_append_only BEFORE UPDATE OR DELETE ON audit_log
        FOR EACH ROW EXECUTE FUNCTION geofed_audit_append_only()""",
)

MIGRATIONS: tuple[tuple[int, tuple[str, ...]], ...] = ((1, _SCHEMA_V1),)
"""(version, statements) in ascending order; append a new entry to change the schema."""
SCHEMA_VERSION = MIGRATIONS[-1][0]


class PostgresStore(SqlStore):
    """Coordinator state in a PostgreSQL database. See the module docstring."""

    _JOB_ORDER = "seq"
    _DB_ERROR = _DRIVER_ERROR

    def __init__(
        self,
        dsn: str,
        *,
        clock: Callable[[], float] = time.time,
        connect_timeout_s: float = 10.0,
        statement_timeout_s: float = 30.0,
        fence: Fence | None = None,
        read_only: bool = False,
    ) -> None:
        """Connect (and migrate the schema, unless ``read_only``).

        ``read_only``: a standby's reader. The server refuses every write of the session
        (``default_transaction_read_only``), and the schema is checked, never migrated, so
        a standby of a newer release never upgrades it under a running leader.
        """
        if _MISSING:
            raise StoreFailure(
                "the PostgreSQL state store needs psycopg 3 (pip install 'geofed[postgres]'): "
                + _MISSING
            )
        self._where = describe_dsn(dsn)
        self._clock = clock
        self._fence = fence
        self._lock = threading.RLock()
        self._depth = 0
        self._closed = False
        try:
            self._conn = psycopg.connect(
                dsn,
                autocommit=True,
                connect_timeout=max(1, round(connect_timeout_s)),
                options=f"-c statement_timeout={round(statement_timeout_s * 1000)}"
                + (" -c default_transaction_read_only=on" if read_only else ""),
            )
        except psycopg.Error as exc:
            raise StoreFailure(
                f"cannot connect to the state database {self._where}: {exc}"
            ) from exc
        try:
            if read_only:
                self._check_schema()
            else:
                self._migrate()
        except BaseException:
            self._conn.close()
            raise

    @property
    def where(self) -> str:
        """The server and database, without credentials (for messages)."""
        return self._where

    def schema_version(self) -> int:
        row = self._one("SELECT max(version) FROM geofed_schema_migrations", ())
        return int(row[0] or 0) if row else 0

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self._lock:
            self._check_open()
            savepoint = f"sp{self._depth}" if self._depth else None
            try:
                if savepoint:
                    self._conn.execute(f"SAVEPOINT {savepoint}")
                else:
                    self._conn.execute("BEGIN")
                    self._conn.execute("SELECT pg_advisory_xact_lock(%s)", (WRITER_LOCK,))
                    self._check_fence()
            except psycopg.Error as exc:
                self._undo(savepoint)
                raise StoreFailure(f"cannot begin a transaction on {self.where}: {exc}") from exc
            except StoreFenced:
                self._undo(savepoint)
                raise
            with self._begun(savepoint, f"RELEASE SAVEPOINT {savepoint}", self.where):
                yield

    # Audit log.

    def append_audit(self, event: AuditEvent) -> AuditEntry:
        try:
            fields = validated_fields(event)
        except InvalidAuditEntry as exc:
            raise InvalidValue(str(exc)) from None
        with self.transaction():
            row = self._one("SELECT seq, hash FROM audit_log ORDER BY seq DESC LIMIT 1", ())
            seq, prev_hash = (int(row[0]) + 1, str(row[1])) if row else (1, GENESIS_HASH)
            entry = chained_entry(fields, seq, prev_hash, self._clock())
            self._execute(
                f"INSERT INTO audit_log ({AUDIT_COLUMNS})"  # noqa: S608
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                entry_row(entry),
            )
        return entry

    def audit_entries(
        self, after_seq: int = 0, limit: int = 100, job: str | None = None
    ) -> list[AuditEntry]:
        if not 1 <= limit <= MAX_PAGE:
            raise InvalidValue(f"limit must be 1..{MAX_PAGE}, got {limit}")
        if after_seq < 0:
            raise InvalidValue(f"after_seq must be >= 0, got {after_seq}")
        query = f"SELECT {AUDIT_COLUMNS} FROM audit_log WHERE seq > ?"  # noqa: S608
        params: list[Any] = [after_seq]
        if job is not None:
            try:
                params.append(validate_name("job", job))
            except ValueError as exc:
                raise InvalidValue(str(exc)) from None
            query += " AND job = ?"
        query += " ORDER BY seq LIMIT ?"
        params.append(limit)
        return [entry_from_row(row) for row in self._all(query, tuple(params))]

    def audit_head(self) -> tuple[int, str]:
        row = self._one("SELECT seq, hash FROM audit_log ORDER BY seq DESC LIMIT 1", ())
        return (int(row[0]), str(row[1])) if row else (0, GENESIS_HASH)

    def verify_audit(self, *, expect_head: tuple[int, str] | None = None) -> VerifyResult:
        rows = self._all(f"SELECT {AUDIT_COLUMNS} FROM audit_log ORDER BY seq", ())  # noqa: S608
        return verify_chain(
            rows_as_entries(rows), prev_hash=GENESIS_HASH, start_seq=1, expect_head=expect_head
        )

    # Internals.

    def _migrate(self) -> None:
        with self.transaction():
            self._execute(
                "CREATE TABLE IF NOT EXISTS geofed_schema_migrations"
                " (version BIGINT PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)",
                (),
            )
            current = self._one("SELECT max(version) FROM geofed_schema_migrations", ())
            current_version = int(current[0] or 0) if current else 0
            if current_version > SCHEMA_VERSION:
                raise SchemaError(
                    f"{self.where} has schema version {current_version}; this coordinator"
                    f" knows up to {SCHEMA_VERSION}: upgrade the coordinator"
                )
            for version, statements in MIGRATIONS:
                if version <= current_version:
                    continue
                for statement in statements:
                    self._execute(statement, ())
                self._execute(
                    "INSERT INTO geofed_schema_migrations (version, applied_at) VALUES (?, ?)",
                    (version, self._clock()),
                )

    def _check_schema(self) -> None:
        """A reader's check: the schema is exactly the one this coordinator knows."""
        version = self.schema_version()
        if version != SCHEMA_VERSION:
            raise SchemaError(
                f"{self.where} has schema version {version}; this coordinator reads"
                f" version {SCHEMA_VERSION} (the leader migrates it)"
            )

    def _execute(self, query: str, params: Sequence[Any]) -> int:
        return int(self._conn.execute(_native(query), params).rowcount)

    def _one(self, query: str, params: Sequence[Any]) -> tuple[Any, ...] | None:
        with self._reading():
            row: tuple[Any, ...] | None = self._conn.execute(_native(query), params).fetchone()
        return row

    def _all(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        with self._reading():
            rows: list[tuple[Any, ...]] = self._conn.execute(_native(query), params).fetchall()
        return rows

    @contextmanager
    def _reading(self) -> Iterator[None]:
        with self._lock:
            self._check_open()
            try:
                yield
            except psycopg.Error as exc:
                raise StoreFailure(f"state database {self.where}: {exc}") from exc

    def _undo(self, savepoint: str | None) -> None:
        try:
            if savepoint:
                self._conn.execute(f"ROLLBACK TO SAVEPOINT {savepoint}")
                self._conn.execute(f"RELEASE SAVEPOINT {savepoint}")
            else:
                self._conn.execute("ROLLBACK")
        except psycopg.Error:
            # A broken connection rolls the transaction back on the server's side.
            pass

    def _check_fence(self) -> None:
        """Under the writer lock: refuse to write unless the lease still has our token."""
        if self._fence is None:
            return
        row = self._conn.execute(
            f"SELECT holder, token FROM {LEASE_TABLE} WHERE name = %s",  # noqa: S608
            (self._fence.name,),
        ).fetchone()
        if row is None or int(row[1]) != self._fence.token:
            holder = "nobody" if row is None else f"{row[0]} with token {row[1]}"
            raise StoreFenced(
                f"{self.where}: this coordinator's leader lease (token {self._fence.token}) "
                f"was taken over ({holder} leads); refusing to write"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"state store {self.where} is closed")

    def __repr__(self) -> str:
        return f"PostgresStore({self.where!r})"


def describe_dsn(dsn: str) -> str:
    """``postgresql://host:port/dbname`` of a connection string, never its password."""
    if _MISSING:
        return "postgresql"
    try:
        parts = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "postgresql (an unreadable connection string)"
    host, port = parts.get("host") or "localhost", parts.get("port") or 5432
    return f"postgresql://{host}:{port}/{parts.get('dbname') or parts.get('user') or ''}"


def _native(query: str) -> bytes:
    """The shared SQL's ``?`` placeholders as psycopg's ``%s`` (no literal ``?`` in it)."""
    return query.replace("%", "%%").replace("?", "%s").encode()
