"""Each job's own blob store: its accepted deltas and its working state.

Blobs are named by their content, so identical bytes are one blob, and two jobs do write
identical bytes: the same base model's θ_0, an outer optimizer's zero momentum, or every
delta of two jobs trained alike. Each job deletes what it no longer needs (a published
round's deltas, a working state saved over), so in one store shared by the jobs the first
to delete a blob took it from the other, which then could neither publish nor restart.
Every job therefore writes and deletes in a store of its own,
``<state_dir>/blobs/jobs/<job>/``.

Blobs written before the jobs had their own stores lie directly under
``<state_dir>/blobs/``. When the coordinator starts, each job adopts those it still needs
(:meth:`JobBlobStore.adopt_legacy`, from :mod:`coordinator.jobs.legacy_blobs`); a job
whose own store lacks a blob still reads it from there, and nothing deletes them
(``docs/operations.md``, "Working blobs").
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from pathlib import Path

from geofed.blobstore import FsBlobStore
from geofed.fsutil import fsync_dir
from geofed.types import validate_name

__all__ = ["JobBlobStore", "JobBlobStores"]


class JobBlobStore(FsBlobStore):
    """One job's blobs; reads fall back to the store shared before (``legacy``)."""

    def __init__(self, root: Path, legacy: FsBlobStore) -> None:
        super().__init__(root)
        self._legacy = legacy

    def read_path(self, digest: str) -> Path:
        own = self.path_of(digest)
        if own.is_file():
            return own
        older = self._legacy.path_of(digest)
        return older if older.is_file() else own

    def adopt_legacy(self, digests: Iterable[str]) -> int:
        """Make the blobs ``digests`` that only the shared store holds this job's own too
        (a hard link, or a checked copy across filesystems); how many it made. The shared
        store's copies stay."""
        adopted = 0
        for digest in dict.fromkeys(digests):
            own, older = self.path_of(digest), self._legacy.path_of(digest)
            if own.is_file() or not older.is_file():
                continue
            self._make_dir(own.parent)
            try:
                os.link(older, own)
                fsync_dir(own.parent)
            except FileExistsError:
                continue
            except OSError:
                with self._legacy.open(digest) as reader:
                    self.put_stream(reader, expected_digest=digest)
            adopted += 1
        return adopted


class JobBlobStores:
    """The jobs' stores under one state directory, each opened once."""

    def __init__(self, state_dir: Path) -> None:
        #: Where every job's blobs lived before each had its own store (read only).
        self.legacy = FsBlobStore(state_dir / "blobs")
        self._jobs_root = state_dir / "blobs" / "jobs"
        self._stores: dict[str, JobBlobStore] = {}
        self._lock = threading.Lock()

    def for_job(self, job: str) -> JobBlobStore:
        """The store of ``job`` (made on first use)."""
        validate_name("job", job)
        with self._lock:
            store = self._stores.get(job)
            if store is None:
                store = JobBlobStore(self._jobs_root / job, self.legacy)
                self._stores[job] = store
            return store

    def legacy_count(self) -> int:
        """How many blobs the shared store of earlier versions still holds."""
        return sum(1 for _ in self.legacy.iter_digests())
