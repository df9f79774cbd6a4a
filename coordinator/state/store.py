"""The coordinator's state store: the narrow interface and its shared types.

Jobs, rounds (with the round state machine's opaque JSON state), receipts of accepted
deltas, resumable-upload progress, per-job pointers (outer-optimizer state, parameter
blobs) and the audit log. Every write is durable when the call returns, and
:meth:`Store.transaction` groups several writes so they commit together or not at all.

Two implementations keep the same contract (``tests/support/store_contract.py``): SQLite,
embedded (:mod:`coordinator.state.sqlite`, the default), and PostgreSQL
(:mod:`coordinator.state.postgres`); the coordinator config's ``state_store`` picks one
(:func:`coordinator.state.backends.open_state_store`).
The API blocks by design: the daemon calls it through
:class:`~coordinator.state.async_store.AsyncStore`, on one dedicated worker thread, never on
the event loop.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from coordinator.state.audit import AuditEntry, AuditEvent, VerifyResult
from geofed.blobstore import validate_digest
from geofed.types import validate_name

#: The largest integer the state database stores (SQLite's INTEGER is 64-bit, signed).
MAX_STORED_INT = 2**63 - 1

_STATE_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_POINTER_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,127}$")
MAX_POINTER_VALUE = 4096


class StoreError(Exception):
    """Base class of state store errors."""


class InvalidValue(StoreError, ValueError):
    """An argument is malformed; nothing was written."""


class MissingRecord(StoreError, LookupError):
    """The job (or other record) a write refers to does not exist."""


class ConflictError(StoreError):
    """A write contradicts what is already stored under the same key."""


class AlreadyExists(ConflictError):
    """A record with this key exists and may not be created again."""


class StoreFailure(StoreError):
    """The backend failed (I/O error, lock held too long, damaged file); nothing was written."""


class SchemaError(StoreError):
    """The stored schema is unknown to (newer than) this version of the coordinator."""


class StoreClosed(StoreError):
    """The store was closed."""


@dataclass(frozen=True, slots=True)
class JobRecord:
    job_id: str
    spec: Mapping[str, Any] = field(hash=False)
    state: str
    created_at: float
    updated_at: float


@dataclass(frozen=True, slots=True)
class StoredRound:
    """A round's opaque state as stored (the round driver owns its meaning)."""

    job_id: str
    round: int
    state: Mapping[str, Any] = field(hash=False)
    updated_at: float


@dataclass(frozen=True, slots=True)
class DeltaTotals:
    """What one region's accepted deltas of a job add up to, from their receipts."""

    deltas: int
    bytes: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Receipt:
    """Proof that a region's delta for a round was accepted and is durable."""

    job_id: str
    round: int
    region: str
    manifest_digest: str
    blob_digest: str
    size: int
    tokens: int
    received_at: float

    def same_delta(self, other: Receipt) -> bool:
        """Whether two receipts describe the same upload (ignoring when it arrived)."""
        return (
            self.job_id,
            self.round,
            self.region,
            self.manifest_digest,
            self.blob_digest,
            self.size,
            self.tokens,
        ) == (
            other.job_id,
            other.round,
            other.region,
            other.manifest_digest,
            other.blob_digest,
            other.size,
            other.tokens,
        )


@runtime_checkable
class Store(Protocol):
    """Coordinator state. Blocking; call from one worker thread (see module docstring)."""

    def transaction(self) -> AbstractContextManager[None]:
        """Group writes: all commit when the block exits cleanly, none if it raises.

        Nests: an inner block that raises rolls back only its own writes (and the
        exception continues to the outer block, which rolls back too unless caught).
        """
        ...

    def close(self) -> None: ...

    # Jobs.
    def create_job(self, job_id: str, spec: Mapping[str, Any], state: str) -> JobRecord:
        """Create a job; :class:`AlreadyExists` if the id is taken."""
        ...

    def get_job(self, job_id: str) -> JobRecord | None: ...

    def list_jobs(self, state: str | None = None) -> list[JobRecord]:
        """Jobs ordered by creation, optionally only those in ``state``."""
        ...

    def set_job_state(self, job_id: str, state: str, *, expected: str | None = None) -> JobRecord:
        """Change a job's state; with ``expected``, only from that state (else ConflictError)."""
        ...

    # Rounds.
    def save_round(self, job_id: str, round: int, state: Mapping[str, Any]) -> StoredRound:
        """Create or replace a round's state."""
        ...

    def load_round(self, job_id: str, round: int) -> StoredRound | None: ...

    def latest_round(self, job_id: str) -> StoredRound | None:
        """The round with the highest number, or None."""
        ...

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
        """Record an accepted delta; idempotent on (job, round, region).

        An identical second call returns the stored receipt; a different one for the same
        key raises :class:`ConflictError`.
        """
        ...

    def list_receipts(self, job_id: str, round: int) -> list[Receipt]:
        """Receipts of a round, ordered by region."""
        ...

    def receipt_totals(self, job_id: str) -> dict[str, DeltaTotals]:
        """Per region, the job's accepted deltas over every round: count, bytes, tokens."""
        ...

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
        """Note a chunk as received; same chunk again is a no-op, a different one conflicts."""
        ...

    def uploaded_chunks(
        self, job_id: str, round: int, region: str, manifest_digest: str
    ) -> dict[int, str]:
        """Chunks received so far for one upload: index -> chunk digest."""
        ...

    def clear_upload(
        self, job_id: str, round: int, region: str, manifest_digest: str | None = None
    ) -> int:
        """Forget upload progress (of one manifest, or all); return how many chunks."""
        ...

    # Per-job pointers.
    def set_pointer(self, job_id: str, name: str, value: str) -> None: ...

    def get_pointer(self, job_id: str, name: str) -> str | None: ...

    def list_pointers(self, job_id: str) -> dict[str, str]: ...

    # Audit log.
    def append_audit(self, event: AuditEvent) -> AuditEntry:
        """Append an audit entry, in the open transaction if there is one."""
        ...

    def audit_entries(
        self, after_seq: int = 0, limit: int = 100, job: str | None = None
    ) -> list[AuditEntry]: ...

    def audit_head(self) -> tuple[int, str]:
        """(seq, hash) of the newest audit entry: record it elsewhere to detect truncation."""
        ...

    def verify_audit(self, *, expect_head: tuple[int, str] | None = None) -> VerifyResult:
        """Check the whole audit chain; ``first_bad_seq`` pinpoints a break."""
        ...


# Validation shared by implementations, so every backend refuses the same input.


def check_job_id(job_id: str) -> str:
    return _named("job id", job_id)


def check_region(region: str) -> str:
    return _named("region", region)


def check_state(state: str) -> str:
    if not isinstance(state, str) or not _STATE_RE.fullmatch(state):
        raise InvalidValue(f"invalid job state {state!r}: use 1-32 lowercase letters, digits, _")
    return state


def check_round(round_: int) -> int:
    return check_count("round", round_)


def check_count(what: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidValue(f"{what} must be a non-negative integer, got {value!r}")
    return value


def check_digest(what: str, digest: str) -> str:
    try:
        return validate_digest(digest)
    except ValueError as exc:
        raise InvalidValue(f"{what}: {exc}") from None


def check_pointer(name: str, value: str) -> None:
    check_pointer_name(name)
    if not isinstance(value, str) or len(value) > MAX_POINTER_VALUE:
        raise InvalidValue(f"pointer {name!r} value must be a string of <= {MAX_POINTER_VALUE}")


def check_pointer_name(name: str) -> str:
    if not isinstance(name, str) or not _POINTER_RE.fullmatch(name):
        raise InvalidValue(f"invalid pointer name {name!r}: use [a-z0-9][a-z0-9_.-]*, <= 128")
    return name


def to_json(what: str, value: Mapping[str, Any]) -> str:
    """Deterministic JSON text of a JSON object; InvalidValue if it is not one."""
    if not isinstance(value, Mapping):
        raise InvalidValue(f"{what} must be a JSON object, got {type(value).__name__}")
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidValue(f"{what} is not JSON-serializable: {exc}") from None


def _named(what: str, value: str) -> str:
    try:
        return validate_name(what, value)
    except ValueError as exc:
        raise InvalidValue(str(exc)) from None
