"""The state store's rules in SQL, once, for every SQL database it runs on.

:class:`SqlStore` implements the jobs, rounds, receipts, upload progress and pointers of
:class:`~coordinator.state.store.Store` (validation, check-then-write under the store's
transaction, conflicts) in portable SQL with ``?`` placeholders. A backend
(:class:`coordinator.state.sqlite.SqliteStore`, :class:`coordinator.state.postgres.PostgresStore`)
supplies the connection: :meth:`transaction`, :meth:`_execute`, :meth:`_one`, :meth:`_all`
(translating the placeholders where it must), the audit log, and how it orders jobs by
creation (``_JOB_ORDER``). The tables of those records are written here once too
(:func:`core_schema`), in each database's column types (:class:`SqlTypes`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

from coordinator.state.store import (
    AlreadyExists,
    ConflictError,
    DeltaTotals,
    JobRecord,
    MissingRecord,
    Receipt,
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

__all__ = ["SqlStore", "SqlTypes", "core_schema"]


@dataclass(frozen=True, slots=True)
class SqlTypes:
    """A database's spelling of the column types :func:`core_schema` uses; ``job_seq``:
    a column that numbers jobs in creation order, where the database has no row id."""

    integer: str
    real: str
    job_seq: str = ""


_CORE_TABLES: tuple[str, ...] = (
    """CREATE TABLE jobs ({job_seq}
        job_id TEXT PRIMARY KEY,
        spec TEXT NOT NULL,
        state TEXT NOT NULL,
        created_at {real} NOT NULL,
        updated_at {real} NOT NULL)""",
    """CREATE TABLE rounds (
        job_id TEXT NOT NULL REFERENCES jobs (job_id),
        round {integer} NOT NULL CHECK (round >= 0),
        state TEXT NOT NULL,
        updated_at {real} NOT NULL,
        PRIMARY KEY (job_id, round))""",
    """CREATE TABLE receipts (
        job_id TEXT NOT NULL REFERENCES jobs (job_id),
        round {integer} NOT NULL CHECK (round >= 0),
        region TEXT NOT NULL,
        manifest_digest TEXT NOT NULL,
        blob_digest TEXT NOT NULL,
        size {integer} NOT NULL CHECK (size >= 0),
        tokens {integer} NOT NULL CHECK (tokens >= 0),
        received_at {real} NOT NULL,
        PRIMARY KEY (job_id, round, region))""",
    """CREATE TABLE upload_chunks (
        job_id TEXT NOT NULL REFERENCES jobs (job_id),
        round {integer} NOT NULL,
        region TEXT NOT NULL,
        manifest_digest TEXT NOT NULL,
        chunk_index {integer} NOT NULL CHECK (chunk_index >= 0),
        digest TEXT NOT NULL,
        size {integer} NOT NULL CHECK (size >= 0),
        PRIMARY KEY (job_id, round, region, manifest_digest, chunk_index))""",
    """CREATE TABLE pointers (
        job_id TEXT NOT NULL REFERENCES jobs (job_id),
        name TEXT NOT NULL,
        value TEXT NOT NULL,
        updated_at {real} NOT NULL,
        PRIMARY KEY (job_id, name))""",
)


def core_schema(types: SqlTypes) -> tuple[str, ...]:
    """The statements that create the jobs, rounds, receipts, upload progress and pointers
    tables (schema version 1), in ``types``."""
    job_seq = f"\n        {types.job_seq}," if types.job_seq else ""
    return tuple(
        statement.format(integer=types.integer, real=types.real, job_seq=job_seq)
        for statement in _CORE_TABLES
    )


_RECEIPT_COLUMNS = "job_id, round, region, manifest_digest, blob_digest, size, tokens, received_at"


class SqlStore:
    """The shared part of the SQL stores (see the module docstring)."""

    #: The expression that lists jobs in creation order.
    _JOB_ORDER: ClassVar[str]
    #: The driver's error class, which the store turns into :class:`StoreFailure`.
    _DB_ERROR: ClassVar[type[Exception]]
    _clock: Callable[[], float]
    _conn: Any
    _lock: threading.RLock
    _depth: int
    _closed: bool

    def transaction(self) -> AbstractContextManager[None]:
        raise NotImplementedError

    def _undo(self, savepoint: str | None) -> None:
        """Roll back to ``savepoint`` (None: the whole transaction), ignoring failures."""
        raise NotImplementedError

    @contextmanager
    def _begun(self, savepoint: str | None, release: str, where: str) -> Iterator[None]:
        """The body of a transaction (or savepoint) that has begun: undone on any error,
        ``release`` or COMMIT at the end; database errors become :class:`StoreFailure`."""
        self._depth += 1
        try:
            yield
        except BaseException as exc:
            self._depth -= 1
            self._undo(savepoint)
            if isinstance(exc, self._DB_ERROR):
                raise StoreFailure(f"state database {where}: {exc}") from exc
            raise
        self._depth -= 1
        try:
            self._conn.execute(release if savepoint else "COMMIT")
        except self._DB_ERROR as exc:
            self._undo(savepoint)
            raise StoreFailure(f"commit failed on {where}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._depth:
                raise StoreFailure("cannot close the store inside a transaction")
            self._closed = True
            self._conn.close()

    def _execute(self, query: str, params: Sequence[Any]) -> int:
        """Run a write (inside :meth:`transaction`); the rows it touched."""
        raise NotImplementedError

    def _one(self, query: str, params: Sequence[Any]) -> tuple[Any, ...] | None:
        raise NotImplementedError

    def _all(self, query: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    # Jobs.

    def create_job(self, job_id: str, spec: Mapping[str, Any], state: str) -> JobRecord:
        check_job_id(job_id)
        spec_json = to_json("job spec", spec)
        check_state(state)
        with self.transaction():
            if self._job_exists(job_id):
                raise AlreadyExists(f"job {job_id!r} already exists")
            now = self._clock()
            self._execute(
                "INSERT INTO jobs (job_id, spec, state, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (job_id, spec_json, state, now, now),
            )
        return JobRecord(job_id, json.loads(spec_json), state, now, now)

    def get_job(self, job_id: str) -> JobRecord | None:
        check_job_id(job_id)
        row = self._one(
            "SELECT job_id, spec, state, created_at, updated_at FROM jobs WHERE job_id = ?",
            (job_id,),
        )
        return _job(row) if row else None

    def list_jobs(self, state: str | None = None) -> list[JobRecord]:
        query = "SELECT job_id, spec, state, created_at, updated_at FROM jobs"
        params: tuple[str, ...] = ()
        if state is not None:
            query += " WHERE state = ?"
            params = (check_state(state),)
        return [_job(row) for row in self._all(f"{query} ORDER BY {self._JOB_ORDER}", params)]

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
            self._execute(
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
            self._execute(
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
            row = self._one(
                f"SELECT {_RECEIPT_COLUMNS} FROM receipts"  # noqa: S608
                " WHERE job_id = ? AND round = ? AND region = ?",
                key,
            )
            receipt = Receipt(*key, manifest_digest, blob_digest, size, tokens, self._clock())
            if row is not None:
                existing = Receipt(*row)
                if existing.same_delta(receipt):
                    return existing
                raise ConflictError(
                    f"region {region!r} already has a different delta accepted for job"
                    f" {job_id!r} round {round} (manifest {existing.manifest_digest})"
                )
            self._execute(
                f"INSERT INTO receipts ({_RECEIPT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",  # noqa: S608
                (*key, manifest_digest, blob_digest, size, tokens, receipt.received_at),
            )
        return receipt

    def list_receipts(self, job_id: str, round: int) -> list[Receipt]:
        check_job_id(job_id)
        check_round(round)
        rows = self._all(
            f"SELECT {_RECEIPT_COLUMNS} FROM receipts"  # noqa: S608
            " WHERE job_id = ? AND round = ? ORDER BY region",
            (job_id, round),
        )
        return [Receipt(*row) for row in rows]

    def receipt_totals(self, job_id: str) -> dict[str, DeltaTotals]:
        check_job_id(job_id)
        rows = self._all(
            "SELECT region, COUNT(*), SUM(size), SUM(tokens) FROM receipts"
            " WHERE job_id = ? GROUP BY region ORDER BY region",
            (job_id,),
        )
        return {
            str(region): DeltaTotals(int(count), int(size), int(tokens))
            for region, count, size, tokens in rows
        }

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
            row = self._one(
                "SELECT digest, size FROM upload_chunks WHERE job_id = ? AND round = ?"
                " AND region = ? AND manifest_digest = ? AND chunk_index = ?",
                (*key, index),
            )
            if row is not None:
                if (row[0], row[1]) == (digest, size):
                    return
                raise ConflictError(
                    f"chunk {index} of upload {manifest_digest} (job {job_id!r} round {round}"
                    f" region {region!r}) was already received with digest {row[0]}"
                )
            self._execute(
                "INSERT INTO upload_chunks (job_id, round, region, manifest_digest, chunk_index,"
                " digest, size) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (*key, index, digest, size),
            )

    def uploaded_chunks(
        self, job_id: str, round: int, region: str, manifest_digest: str
    ) -> dict[int, str]:
        key = _upload_key(job_id, round, region, manifest_digest)
        rows = self._all(
            "SELECT chunk_index, digest FROM upload_chunks WHERE job_id = ? AND round = ?"
            " AND region = ? AND manifest_digest = ? ORDER BY chunk_index",
            key,
        )
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
            return self._execute(query, params)

    # Per-job pointers.

    def set_pointer(self, job_id: str, name: str, value: str) -> None:
        check_job_id(job_id)
        check_pointer(name, value)
        with self.transaction():
            self._require_job(job_id)
            self._execute(
                "INSERT INTO pointers (job_id, name, value, updated_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (job_id, name)"
                " DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at",
                (job_id, name, value, self._clock()),
            )

    def get_pointer(self, job_id: str, name: str) -> str | None:
        check_job_id(job_id)
        check_pointer_name(name)
        row = self._one("SELECT value FROM pointers WHERE job_id = ? AND name = ?", (job_id, name))
        return str(row[0]) if row else None

    def list_pointers(self, job_id: str) -> dict[str, str]:
        check_job_id(job_id)
        rows = self._all(
            "SELECT name, value FROM pointers WHERE job_id = ? ORDER BY name", (job_id,)
        )
        return {str(name): str(value) for name, value in rows}

    # Internals.

    def _job_exists(self, job_id: str) -> bool:
        return self._one("SELECT 1 FROM jobs WHERE job_id = ?", (job_id,)) is not None

    def _require_job(self, job_id: str) -> None:
        if not self._job_exists(job_id):
            raise MissingRecord(f"no job {job_id!r}")

    def _one_round(self, where: str, params: tuple[object, ...]) -> StoredRound | None:
        row = self._one(
            f"SELECT job_id, round, state, updated_at FROM rounds {where}",  # noqa: S608
            params,
        )
        return StoredRound(row[0], int(row[1]), json.loads(row[2]), row[3]) if row else None


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
