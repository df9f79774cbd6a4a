"""Building and checking checkpoint chains in a
:class:`~coordinator.storage.checkpoints.CheckpointStore`.

Shared by ``tests/unit/test_checkpoints.py`` and the killed-writer test in
``tests/integration/test_killed_writers.py``.
"""

from __future__ import annotations

from pathlib import Path

from coordinator.storage.checkpoints import CheckpointEntry, CheckpointStore

JOB = "job-a"


class TickingClock:
    """A wall clock that moves one second forward at each reading."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def open_store(root: Path) -> CheckpointStore:
    """The ``eu-vault`` location at ``root``, on a :class:`TickingClock`."""
    return CheckpointStore("eu-vault", root, clock=TickingClock())


def put_pair(store: CheckpointStore, label: str) -> tuple[str, str]:
    """Store a payload and its manifest, as the caller does before recording."""
    return store.blobs.put(f"payload {label}".encode()), store.blobs.put(
        f"manifest {label}".encode()
    )


def snapshot(store: CheckpointStore, round_: int, job: str = JOB) -> CheckpointEntry:
    """Record a snapshot of ``job`` at ``round_`` (its blobs stored first)."""
    return store.record_snapshot(job, round_, *put_pair(store, f"{job} snapshot {round_}"))


def update(store: CheckpointStore, round_: int, job: str = JOB) -> CheckpointEntry:
    """Record the update of ``job``'s round ``round_`` (its blobs stored first)."""
    return store.record_update(job, round_, *put_pair(store, f"{job} update {round_}"))


def assert_restorable(store: CheckpointStore, job: str = JOB) -> None:
    """``job``'s latest chain exists and every blob it names is present and intact."""
    chain = store.latest(job)
    assert chain is not None
    for digest in chain.digests():
        store.blobs.get(digest)  # present and intact
