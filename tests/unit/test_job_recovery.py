"""What a restarted engine announces as the update behind its parameters."""

from __future__ import annotations

from coordinator.jobs.recovery import last_update_digest
from coordinator.storage.checkpoints import CheckpointEntry, EntryKind


def _entry(kind: EntryKind, round_: int, manifest: str) -> CheckpointEntry:
    return CheckpointEntry(kind, round_, "00" * 32, manifest, 1_700_000_000.0 + round_)


ENTRIES = [
    _entry(EntryKind.SNAPSHOT, 0, "a0" * 32),
    _entry(EntryKind.UPDATE, 0, "b0" * 32),
    _entry(EntryKind.UPDATE, 1, "b1" * 32),
    _entry(EntryKind.SNAPSHOT, 2, "a2" * 32),
]


def test_the_update_that_produced_the_parameters() -> None:
    assert last_update_digest(ENTRIES, 1) == "b0" * 32
    assert last_update_digest(ENTRIES, 2) == "b1" * 32


def test_initial_parameters_have_no_update() -> None:
    assert last_update_digest(ENTRIES, 0) is None


def test_a_snapshot_is_not_an_update() -> None:
    assert last_update_digest(ENTRIES, 3) is None  # update 2 was never recorded
