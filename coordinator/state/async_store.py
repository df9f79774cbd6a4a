"""The state store, awaitable: every call runs in the store thread.

The coordinator's :class:`~coordinator.state.store.Store` blocks by design. :class:`AsyncStore`
gives the event loop one typed coroutine per store call, each run on the executors' single
store thread (SQLite wants one writer). Writes that must commit together are one function
of :mod:`coordinator.state.transactions`, run whole in that thread by :meth:`AsyncStore.run`;
a transaction cannot stay open across an ``await``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Concatenate, ParamSpec, TypeVar

from coordinator.executors import Executors
from coordinator.state.audit import AuditEntry, AuditEvent, VerifyResult
from coordinator.state.store import DeltaTotals, JobRecord, Receipt, Store, StoredRound

__all__ = ["AsyncStore"]

P = ParamSpec("P")
T = TypeVar("T")


class AsyncStore:
    """:class:`~coordinator.state.store.Store`'s calls as coroutines; see the module docstring.

    Each method has the name, arguments and errors of the store call it runs.
    """

    def __init__(self, store: Store, executors: Executors) -> None:
        self._store = store
        self._executors = executors

    @classmethod
    async def open(cls, opener: Callable[[], Store], executors: Executors) -> AsyncStore:
        """Open a store in the store thread (opening migrates the schema, which blocks)."""
        return cls(await executors.db(opener), executors)

    async def run(
        self, fn: Callable[Concatenate[Store, P], T], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Run ``fn(store, *args, **kwargs)`` in the store thread: one multi-write transaction."""
        return await self._executors.db(fn, self._store, *args, **kwargs)

    async def close(self) -> None:
        await self._executors.db(self._store.close)

    # Jobs.

    async def create_job(self, job_id: str, spec: Mapping[str, Any], state: str) -> JobRecord:
        return await self._executors.db(self._store.create_job, job_id, spec, state)

    async def get_job(self, job_id: str) -> JobRecord | None:
        return await self._executors.db(self._store.get_job, job_id)

    async def list_jobs(self, state: str | None = None) -> list[JobRecord]:
        return await self._executors.db(self._store.list_jobs, state)

    async def set_job_state(
        self, job_id: str, state: str, *, expected: str | None = None
    ) -> JobRecord:
        return await self._executors.db(self._store.set_job_state, job_id, state, expected=expected)

    # Rounds.

    async def save_round(self, job_id: str, round: int, state: Mapping[str, Any]) -> StoredRound:
        return await self._executors.db(self._store.save_round, job_id, round, state)

    async def load_round(self, job_id: str, round: int) -> StoredRound | None:
        return await self._executors.db(self._store.load_round, job_id, round)

    async def latest_round(self, job_id: str) -> StoredRound | None:
        return await self._executors.db(self._store.latest_round, job_id)

    # Delta receipts.

    async def record_receipt(
        self,
        job_id: str,
        round: int,
        region: str,
        manifest_digest: str,
        blob_digest: str,
        size: int,
        tokens: int,
    ) -> Receipt:
        return await self._executors.db(
            self._store.record_receipt,
            job_id,
            round,
            region,
            manifest_digest,
            blob_digest,
            size,
            tokens,
        )

    async def list_receipts(self, job_id: str, round: int) -> list[Receipt]:
        return await self._executors.db(self._store.list_receipts, job_id, round)

    async def receipt_totals(self, job_id: str) -> dict[str, DeltaTotals]:
        return await self._executors.db(self._store.receipt_totals, job_id)

    async def receipt(self, job_id: str, round: int, region: str) -> Receipt | None:
        """The receipt of ``region``'s delta for ``round``, if one was accepted."""
        receipts = await self.list_receipts(job_id, round)
        return next((r for r in receipts if r.region == region), None)

    # Resumable upload progress.

    async def record_upload_chunk(
        self,
        job_id: str,
        round: int,
        region: str,
        manifest_digest: str,
        index: int,
        digest: str,
        size: int,
    ) -> None:
        await self._executors.db(
            self._store.record_upload_chunk,
            job_id,
            round,
            region,
            manifest_digest,
            index,
            digest,
            size,
        )

    async def uploaded_chunks(
        self, job_id: str, round: int, region: str, manifest_digest: str
    ) -> dict[int, str]:
        return await self._executors.db(
            self._store.uploaded_chunks, job_id, round, region, manifest_digest
        )

    async def clear_upload(
        self, job_id: str, round: int, region: str, manifest_digest: str | None = None
    ) -> int:
        return await self._executors.db(
            self._store.clear_upload, job_id, round, region, manifest_digest
        )

    # Per-job pointers.

    async def set_pointer(self, job_id: str, name: str, value: str) -> None:
        await self._executors.db(self._store.set_pointer, job_id, name, value)

    async def get_pointer(self, job_id: str, name: str) -> str | None:
        return await self._executors.db(self._store.get_pointer, job_id, name)

    async def list_pointers(self, job_id: str) -> dict[str, str]:
        return await self._executors.db(self._store.list_pointers, job_id)

    # Audit log.

    async def append_audit(self, event: AuditEvent) -> AuditEntry:
        return await self._executors.db(self._store.append_audit, event)

    async def audit_entries(
        self, after_seq: int = 0, limit: int = 100, job: str | None = None
    ) -> list[AuditEntry]:
        return await self._executors.db(self._store.audit_entries, after_seq, limit, job)

    async def audit_head(self) -> tuple[int, str]:
        return await self._executors.db(self._store.audit_head)

    async def verify_audit(self, *, expect_head: tuple[int, str] | None = None) -> VerifyResult:
        return await self._executors.db(self._store.verify_audit, expect_head=expect_head)
