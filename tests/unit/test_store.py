"""The coordinator state store: the shared contract on SQLite, and SQLite's own checks.

:class:`~tests.support.store_contract.StoreContract` holds the behaviour every
:class:`~coordinator.state.store.Store` must have; it runs here against the embedded SQLite
store, and in ``tests/integration/test_postgres_store.py`` against PostgreSQL (a unit test
opens no socket). A process dying mid-transaction is in
``tests/integration/test_killed_writers.py``, for every implementation of
:data:`tests.support.stores.IMPLEMENTATIONS`. SQLite-only checks (pragmas, file modes,
schema table) are in :class:`TestSqliteSpecifics`.
"""

from __future__ import annotations

import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.state.audit import AuditEvent
from coordinator.state.sqlite import SCHEMA_VERSION, SqliteStore
from coordinator.state.store import (
    SchemaError,
    Store,
)
from tests.support.store_contract import StoreContract
from tests.support.stores import (
    B1,
    JOB,
    M1,
    OPERATOR,
    StoreFactory,
    with_job,
)


@pytest.fixture
def store_factory(tmp_path: Path) -> Iterator[StoreFactory]:
    factory = StoreFactory.for_implementation("sqlite", tmp_path)
    yield factory
    factory.close_all()


@pytest.fixture
def store(store_factory: StoreFactory) -> Store:
    return store_factory()


class TestStoreContract(StoreContract):
    """Runs the contract against the embedded SQLite store."""


class TestSqliteSpecifics:
    def test_pragmas(self, tmp_path: Path) -> None:
        store = SqliteStore(tmp_path / "c.db", busy_timeout_s=2.5)
        try:
            conn = sqlite3.connect(tmp_path / "c.db")
            try:
                assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            finally:
                conn.close()
            pragmas = {
                name: store._conn.execute(f"PRAGMA {name}").fetchone()[0]
                for name in ("synchronous", "foreign_keys", "busy_timeout")
            }
            assert pragmas == {"synchronous": 2, "foreign_keys": 1, "busy_timeout": 2500}
        finally:
            store.close()

    def test_schema_version_and_private_file(self, tmp_path: Path) -> None:
        store = SqliteStore.in_state_dir(tmp_path / "state")
        try:
            assert store.schema_version() == SCHEMA_VERSION == 1
            assert store.path == tmp_path / "state" / "coordinator.db"
            assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
            assert stat.S_IMODE(store.path.parent.stat().st_mode) == 0o700
        finally:
            store.close()
        again = SqliteStore.in_state_dir(tmp_path / "state")  # migrations are not re-run
        try:
            assert again.schema_version() == 1
        finally:
            again.close()

    def test_newer_schema_is_refused(self, tmp_path: Path) -> None:
        SqliteStore(tmp_path / "c.db").close()
        conn = sqlite3.connect(tmp_path / "c.db", isolation_level=None)
        conn.execute("INSERT INTO schema_migrations VALUES (2, 0)")
        conn.close()
        with pytest.raises(SchemaError, match="schema version 2"):
            SqliteStore(tmp_path / "c.db")

    def test_foreign_keys_are_enforced_in_the_database(self, tmp_path: Path) -> None:
        store = SqliteStore(tmp_path / "c.db")
        try:
            with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"):
                store._conn.execute("INSERT INTO pointers VALUES ('job-x', 'p', 'v', 0)")
        finally:
            store.close()

    def test_two_connections_see_each_others_commits(self, tmp_path: Path) -> None:
        a, b = SqliteStore(tmp_path / "c.db"), SqliteStore(tmp_path / "c.db")
        try:
            with_job(a)
            b.record_receipt(JOB, 0, "eu-west", M1, B1, 1, 1)
            assert a.list_receipts(JOB, 0) == b.list_receipts(JOB, 0)
            a.append_audit(AuditEvent(OPERATOR, "a", "ok"))
            b.append_audit(AuditEvent(OPERATOR, "b", "ok"))
            assert [e.seq for e in a.audit_entries()] == [1, 2]
            assert a.verify_audit().ok
        finally:
            a.close()
            b.close()
