"""The incremental global checkpoint chain of each job, in one named storage location.

A job's global model is restorable from a full snapshot plus the published updates
after it; a snapshot is taken every K rounds (the coordinator decides K). Rounds number
versions of the global parameters:

- the snapshot *of round r* holds θ_r, the parameters round r starts from;
- the update *of round r* is the one published when round r closed (θ_r -> θ_{r+1}).

So a chain restores version ``snapshot.round + len(updates)``. Payloads (encoded tensors,
signed manifests) are opaque bytes here, stored in a :class:`~geofed.blobstore.BlobStore`
by the caller before they are recorded. Each job has a small JSON index, written
atomically and last: a checkpoint exists only once the index names it, the index never
names a blob that is not stored, and an interrupted write leaves the previous chain intact.

A job's checkpoints may be placed only where every contributing region's policy allows,
so there are several named locations, each a :class:`CheckpointStore` with its own root;
the coordinator chooses. One process writes a location; a lock serializes its threads.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from geofed.blobstore import BlobStore, FsBlobStore, validate_digest
from geofed.fsutil import StrPath, atomic_write_bytes, fsync_dir
from geofed.types import validate_name

INDEX_FORMAT = 1
INDEX_NAME = "index.json"
IndexWriter = Callable[[Path, bytes], None]


class CheckpointError(Exception):
    """Base class of checkpoint chain errors."""


class CheckpointOrderError(CheckpointError, ValueError):
    """A record would break the chain (wrong round, no snapshot yet); nothing was written."""


class CheckpointConflict(CheckpointError):
    """A different checkpoint is already recorded for that job, kind and round."""


class MissingBlob(CheckpointError):
    """A payload or manifest the chain needs is not in the blob store."""


class CorruptIndex(CheckpointError):
    """A job's checkpoint index cannot be read or is inconsistent."""


class EntryKind(StrEnum):
    SNAPSHOT = "snapshot"
    UPDATE = "update"


@dataclass(frozen=True, slots=True)
class CheckpointEntry:
    """One recorded checkpoint part: a snapshot or an update, with its signed manifest."""

    kind: EntryKind
    round: int
    payload_digest: str
    manifest_digest: str
    recorded_at: float

    def digests(self) -> tuple[str, str]:
        return (self.payload_digest, self.manifest_digest)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "round": self.round,
            "payload_digest": self.payload_digest,
            "manifest_digest": self.manifest_digest,
            "recorded_at": self.recorded_at,
        }

    @classmethod
    def from_json(cls, data: Any) -> CheckpointEntry:
        if not isinstance(data, dict):
            raise TypeError(f"entry is not an object: {data!r}")
        round_ = data["round"]
        recorded_at = data["recorded_at"]
        if not isinstance(round_, int) or isinstance(round_, bool) or round_ < 0:
            raise TypeError(f"bad round {round_!r}")
        if not isinstance(recorded_at, int | float) or isinstance(recorded_at, bool):
            raise TypeError(f"bad recorded_at {recorded_at!r}")
        return cls(
            kind=EntryKind(data["kind"]),
            round=round_,
            payload_digest=validate_digest(data["payload_digest"]),
            manifest_digest=validate_digest(data["manifest_digest"]),
            recorded_at=float(recorded_at),
        )


@dataclass(frozen=True, slots=True)
class CheckpointChain:
    """A restorable global checkpoint: a snapshot and the contiguous updates after it."""

    job: str
    location: str
    snapshot: CheckpointEntry
    updates: tuple[CheckpointEntry, ...]

    @property
    def base_round(self) -> int:
        return self.snapshot.round

    @property
    def round(self) -> int:
        """The version this chain restores: the round the restored parameters start."""
        return self.snapshot.round + len(self.updates)

    def digests(self) -> list[str]:
        """Every blob needed to restore, snapshot first, in application order."""
        return [d for entry in (self.snapshot, *self.updates) for d in entry.digests()]

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "location": self.location,
            "round": self.round,
            "snapshot": self.snapshot.to_json(),
            "updates": [u.to_json() for u in self.updates],
        }


@dataclass(frozen=True, slots=True)
class PruneResult:
    removed: tuple[CheckpointEntry, ...]
    deleted_blobs: tuple[str, ...]


class CheckpointStore:
    """Checkpoint chains of every job in one storage location (``root``).

    Blobs live in ``blobs`` (default: a private :class:`FsBlobStore` at ``root/blobs``);
    indexes at ``root/jobs/<job>/index.json``. ``write_index`` replaces the atomic
    writer, so tests can put a failing disk under it.
    """

    def __init__(
        self,
        location: str,
        root: StrPath,
        *,
        blobs: BlobStore | None = None,
        clock: Callable[[], float] = time.time,
        write_index: IndexWriter | None = None,
    ) -> None:
        self.location = validate_name("checkpoint location", location)
        self.root = Path(root)
        self._jobs_dir = self.root / "jobs"
        self._jobs_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.blobs: BlobStore = blobs if blobs is not None else FsBlobStore(self.root / "blobs")
        self._clock = clock
        self._write_index = write_index or _write_index_atomically
        self._lock = threading.Lock()

    def record_snapshot(
        self, job: str, round: int, snapshot_digest: str, manifest_digest: str
    ) -> CheckpointEntry:
        """Record a full snapshot of θ_round whose blobs are already stored.

        Idempotent for the same digests. A snapshot may start a job's chain at any round
        but may not be older than the newest recorded version.
        """
        return self._record(EntryKind.SNAPSHOT, job, round, snapshot_digest, manifest_digest)

    def record_update(
        self, job: str, round: int, update_digest: str, manifest_digest: str
    ) -> CheckpointEntry:
        """Record round ``round``'s published update; it must extend the chain exactly."""
        return self._record(EntryKind.UPDATE, job, round, update_digest, manifest_digest)

    def latest(self, job: str) -> CheckpointChain | None:
        """The newest restorable chain, or None if the job has no checkpoint here.

        It reaches the newest recorded version from the newest snapshot whose chain is
        complete in the blob store; if none is, :class:`MissingBlob` says what is missing.
        """
        validate_name("job", job)
        with self._lock:
            entries = self._load(job)
        return _restorable(job, self.location, entries, self.blobs)

    def entries(self, job: str) -> list[CheckpointEntry]:
        """Every recorded entry of ``job``, ordered by round (snapshot before update)."""
        validate_name("job", job)
        with self._lock:
            return self._load(job)

    def jobs(self) -> list[str]:
        """Jobs with an index in this location."""
        return sorted(p.parent.name for p in self._jobs_dir.glob(f"*/{INDEX_NAME}"))

    def prune(self, job: str, *, keep_snapshots: int) -> PruneResult:
        """Keep the newest ``keep_snapshots`` snapshots and everything after the oldest kept.

        The index is rewritten first, then blobs that no remaining entry of any job in
        this location references are deleted; a crash in between leaves only orphans.
        """
        validate_name("job", job)
        if keep_snapshots < 1:
            raise ValueError(f"keep_snapshots must be >= 1, got {keep_snapshots}")
        with self._lock:
            snapshots = [e for e in self._load(job) if e.kind is EntryKind.SNAPSHOT]
            if len(snapshots) <= keep_snapshots:
                return PruneResult((), ())
            cutoff = snapshots[-keep_snapshots].round
            return self._remove(job, [e for e in self._load(job) if e.round < cutoff])

    def remove(self, job: str, entries: Sequence[CheckpointEntry]) -> PruneResult:
        """Drop ``entries`` from the job's chain (:mod:`coordinator.storage.retention` chooses
        them).

        The index is rewritten first, then blobs that no remaining entry of any job in
        this location references are deleted; a crash in between leaves only orphans.
        Entries the chain does not hold are ignored.
        """
        validate_name("job", job)
        with self._lock:
            return self._remove(job, entries)

    def _remove(self, job: str, entries: Sequence[CheckpointEntry]) -> PruneResult:
        # The caller holds self._lock.
        current = self._load(job)
        dropped = set(entries)
        kept = [e for e in current if e not in dropped]
        removed = tuple(e for e in current if e in dropped)
        if not removed:
            return PruneResult((), ())
        self._store(job, kept)
        still_used = {d for e in kept for d in e.digests()}
        for other in self.jobs():
            if other != job:
                still_used.update(d for e in self._load(other) for d in e.digests())
        deleted = []
        for digest in dict.fromkeys(d for e in removed for d in e.digests()):
            if digest not in still_used and self.blobs.delete(digest):
                deleted.append(digest)
        return PruneResult(removed, tuple(deleted))

    def _record(
        self, kind: EntryKind, job: str, round_: int, payload: str, manifest: str
    ) -> CheckpointEntry:
        validate_name("job", job)
        if not isinstance(round_, int) or isinstance(round_, bool) or round_ < 0:
            raise CheckpointOrderError(f"round must be a non-negative integer, got {round_!r}")
        validate_digest(payload)
        validate_digest(manifest)
        with self._lock:
            for digest in (payload, manifest):
                if not self.blobs.exists(digest):
                    raise MissingBlob(
                        f"{kind} of job {job!r} round {round_}: blob {digest} is not stored"
                        f" in location {self.location!r}; store blobs before recording them"
                    )
            entries = self._load(job)
            for e in entries:
                if e.kind is kind and e.round == round_:
                    if e.digests() == (payload, manifest):
                        return e
                    raise CheckpointConflict(
                        f"job {job!r} already has a different {kind} for round {round_}"
                    )
            _check_order(kind, job, round_, entries)
            entry = CheckpointEntry(kind, round_, payload, manifest, self._clock())
            self._store(job, sorted([*entries, entry], key=_order))
        return entry

    def _index_path(self, job: str) -> Path:
        return self._jobs_dir / job / INDEX_NAME

    def _load(self, job: str) -> list[CheckpointEntry]:
        path = self._index_path(job)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return []
        try:
            entries = _parse_index(json.loads(raw), job)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptIndex(f"checkpoint index {path} is unreadable: {exc}") from None
        return sorted(entries, key=_order)

    def _store(self, job: str, entries: Iterable[CheckpointEntry]) -> None:
        job_dir = self._jobs_dir / job
        if not job_dir.is_dir():
            job_dir.mkdir(mode=0o700)
            fsync_dir(self._jobs_dir)
        doc = {
            "format": INDEX_FORMAT,
            "job": job,
            "location": self.location,
            "entries": [e.to_json() for e in entries],
        }
        self._write_index(self._index_path(job), json.dumps(doc, indent=1).encode("utf-8"))

    def __repr__(self) -> str:
        return f"CheckpointStore({self.location!r}, {str(self.root)!r})"


def _parse_index(doc: Any, job: str) -> list[CheckpointEntry]:
    if doc.get("format") != INDEX_FORMAT or doc.get("job") != job:
        raise ValueError(f"format {doc.get('format')!r}, job {doc.get('job')!r}")
    return [CheckpointEntry.from_json(e) for e in doc["entries"]]


def _write_index_atomically(path: Path, data: bytes) -> None:
    atomic_write_bytes(path, data, private=True)


def _order(entry: CheckpointEntry) -> tuple[int, int]:
    return (entry.round, 0 if entry.kind is EntryKind.SNAPSHOT else 1)


def _next_version(entries: list[CheckpointEntry]) -> int | None:
    versions = [e.round + (e.kind is EntryKind.UPDATE) for e in entries]
    return max(versions) if versions else None


def _check_order(kind: EntryKind, job: str, round_: int, entries: list[CheckpointEntry]) -> None:
    version = _next_version(entries)
    if kind is EntryKind.SNAPSHOT:
        if version is not None and round_ < version:
            raise CheckpointOrderError(
                f"snapshot of job {job!r} round {round_} is older than its newest"
                f" checkpoint version {version}"
            )
        return
    if version is None:
        raise CheckpointOrderError(
            f"job {job!r} has no snapshot yet: record one before the update of round {round_}"
        )
    if round_ != version:
        raise CheckpointOrderError(
            f"the next update of job {job!r} must be round {version}, got {round_}"
        )


def _restorable(
    job: str, location: str, entries: list[CheckpointEntry], blobs: BlobStore
) -> CheckpointChain | None:
    version = _next_version(entries)
    if version is None:
        return None
    updates = {e.round: e for e in entries if e.kind is EntryKind.UPDATE}
    snapshots = [e for e in entries if e.kind is EntryKind.SNAPSHOT]
    first_problem = ""
    for snapshot in reversed(snapshots):
        chain = [updates.get(r) for r in range(snapshot.round, version)]
        gap = next((snapshot.round + i for i, u in enumerate(chain) if u is None), None)
        if gap is not None:
            problem = f"no update of round {gap} after the snapshot of round {snapshot.round}"
        else:
            needed = [snapshot, *(u for u in chain if u is not None)]
            missing = next(
                ((e, d) for e in needed for d in e.digests() if not blobs.exists(d)), None
            )
            if missing is None:
                present = tuple(u for u in chain if u is not None)
                return CheckpointChain(job, location, snapshot, present)
            problem = f"blob {missing[1]} of the {missing[0].kind} of round {missing[0].round}"
        first_problem = first_problem or problem
    raise MissingBlob(
        f"job {job!r} in location {location!r} cannot be restored to version {version}:"
        f" {first_problem or 'no snapshot'}"
    )
