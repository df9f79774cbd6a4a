"""The state-store contract's vocabulary: the implementations, a factory, sample values.

:data:`IMPLEMENTATIONS` lists every :class:`~coordinator.state.store.Store` the contract runs
against (``tests/unit/test_store.py``, and ``tests/integration/test_killed_writers.py``
for a process that dies mid-transaction). Each entry is a
picklable spec that opens a store on the same backing database each time it is called;
PostgreSQL's creates a fresh database on the test server (:data:`POSTGRES_ENV`), dropped
when the factory closes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from coordinator.state.audit import AuditEvent
from coordinator.state.postgres import PostgresStore
from coordinator.state.sqlite import SqliteStore
from coordinator.state.store import Store
from geofed.blobstore import sha256_hex
from geofed.types import Identity, Role

JOB = "job-a"
SPEC: dict[str, Any] = {"model": "charlm", "regions": ["eu-west", "us-east"], "inner_steps": 50}
M1, M2 = sha256_hex(b"manifest 1"), sha256_hex(b"manifest 2")
B1, B2 = sha256_hex(b"blob 1"), sha256_hex(b"blob 2")
C = [sha256_hex(f"chunk {i}".encode()) for i in range(4)]
OPERATOR = Identity("fed", Role.OPERATOR, "alice")


@dataclass(frozen=True)
class SqliteSpec:
    """Opens a SQLite store on one file; picklable, so a child process can use it."""

    path: Path

    def __call__(self) -> Store:
        return SqliteStore(self.path)


#: The admin connection string of the PostgreSQL server the tests use: each test gets a
#: fresh database on it. Default: the machine's server, trust authentication.
POSTGRES_ENV = "GEOFED_TEST_POSTGRES"
DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"


@dataclass(frozen=True)
class PostgresSpec:
    """Opens a PostgreSQL store on one database; picklable, like :class:`SqliteSpec`."""

    dsn: str
    admin_dsn: str
    database: str

    def __call__(self) -> Store:
        return PostgresStore(self.dsn)

    @classmethod
    def fresh(cls, tmp: Path) -> PostgresSpec:
        """A new, empty database on the test server, named after the test's ``tmp``."""
        admin = os.environ.get(POSTGRES_ENV, DEFAULT_POSTGRES)
        database = "geofed_test_" + sha256_hex(str(tmp).encode())[:16]
        with _admin(admin) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'.encode())
            conn.execute(f'CREATE DATABASE "{database}"'.encode())
        return cls(psycopg.conninfo.make_conninfo(admin, dbname=database), admin, database)

    def drop(self) -> None:
        with _admin(self.admin_dsn) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)'.encode())


def _admin(dsn: str) -> psycopg.Connection[tuple[Any, ...]]:
    try:
        return psycopg.connect(dsn, autocommit=True, connect_timeout=10)
    except psycopg.OperationalError as exc:
        raise RuntimeError(
            f"the PostgreSQL tests need a server: {exc}. This machine's runs on 127.0.0.1:5432 "
            "with trust authentication (Debian: apt-get install postgresql; service postgresql "
            f"start); to use another, set {POSTGRES_ENV} to an admin connection string"
        ) from None


IMPLEMENTATIONS: dict[str, Callable[[Path], Callable[[], Store]]] = {
    "sqlite": lambda tmp: SqliteSpec(tmp / "state" / "coordinator.db"),
    "postgresql": PostgresSpec.fresh,
}


class StoreFactory:
    """Opens stores from ``spec`` and closes whatever a test left open."""

    def __init__(self, spec: Callable[[], Store]) -> None:
        self.spec = spec
        self._opened: list[Store] = []

    @classmethod
    def for_implementation(cls, name: str, tmp_path: Path) -> StoreFactory:
        """A factory for ``IMPLEMENTATIONS[name]`` backed by files under ``tmp_path``."""
        (tmp_path / "state").mkdir()
        return cls(IMPLEMENTATIONS[name](tmp_path))

    def __call__(self) -> Store:
        store = self.spec()
        self._opened.append(store)
        return store

    def close_all(self) -> None:
        for store in self._opened:
            store.close()
        if isinstance(self.spec, PostgresSpec):
            self.spec.drop()


def with_job(store: Store, job_id: str = JOB) -> Store:
    """``store`` with job ``job_id`` (spec :data:`SPEC`) created, running."""
    store.create_job(job_id, SPEC, "running")
    return store


def die_mid_transaction(spec: Callable[[], Store], ready: Any, how: str) -> None:
    """Child process: commit one receipt, then die inside the next transaction.

    ``how`` is ``"exit"`` (``os._exit(1)`` inside the transaction) or ``"kill"`` (set
    ``ready`` and wait there for the parent to kill this process).
    """
    store = spec()
    store.record_receipt(JOB, 1, "eu-west", M1, B1, 100, 10)
    with store.transaction():
        store.create_job("job-half", SPEC, "running")
        store.save_round(JOB, 1, {"phase": "closing"})
        store.record_receipt(JOB, 1, "us-east", M2, B2, 200, 20)
        store.set_pointer(JOB, "params", B2)
        store.append_audit(AuditEvent(OPERATOR, "round.publish", "ok", job=JOB))
        if how == "exit":
            os._exit(1)
        ready.set()
        threading.Event().wait(60)  # the parent kills this process meanwhile
