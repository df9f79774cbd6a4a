"""The state-store contract's vocabulary: the implementations, a factory, sample values.

:data:`IMPLEMENTATIONS` lists every :class:`~coordinator.store.Store` the contract runs
against (``tests/unit/test_store.py``, and ``tests/integration/test_killed_writers.py``
for a process that dies mid-transaction). A PostgreSQL store adds an entry here: a
picklable spec that opens a store on the same backing database each time it is called.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.audit import AuditEvent
from coordinator.sqlite_store import SqliteStore
from coordinator.store import Store
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


IMPLEMENTATIONS: dict[str, Callable[[Path], Callable[[], Store]]] = {
    "sqlite": lambda tmp: SqliteSpec(tmp / "state" / "coordinator.db"),
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
