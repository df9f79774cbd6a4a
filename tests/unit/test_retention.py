"""Which checkpoint entries a job's retention drops (pure, table-driven)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from coordinator.storage.checkpoints import CheckpointEntry, EntryKind
from coordinator.storage.retention import RetentionConfig, plan_retention

S, U = EntryKind.SNAPSHOT, EntryKind.UPDATE


def _chain(last_version: int, snapshot_every: int) -> list[CheckpointEntry]:
    """Snapshots every ``snapshot_every`` versions up to ``last_version``, every update."""
    entries = []
    for version in range(last_version + 1):
        if version % snapshot_every == 0:
            entries.append(CheckpointEntry(S, version, f"{version:064x}", "a" * 64, 0.0))
        if version < last_version:
            entries.append(CheckpointEntry(U, version, f"{version + 100:064x}", "b" * 64, 0.0))
    return entries


@pytest.mark.parametrize(
    ("last", "config", "kept", "reason"),
    [
        # Fewer snapshots than kept: nothing goes.
        (4, {"keep_snapshots": 3}, "S0 U0 U1 S2 U2 U3 S4", "none dropped"),
        # The newest 2 snapshots and the updates after the older one.
        (6, {"keep_snapshots": 2}, "S4 U4 U5 S6", "from round 4 on: 6 older entries dropped"),
        (6, {"keep_snapshots": 1}, "S6", "from round 6 on: 9 older entries dropped"),
        # Every 2nd snapshot (by number: rounds 0, 4, 8...) stays alone, without updates.
        (
            8,
            {"keep_snapshots": 1, "keep_every": 2},
            "S0 S4 S8",
            "archived snapshot(s) of round(s) [0, 4]",
        ),
    ],
)
def test_plan_keeps_the_newest_snapshots_their_chain_and_the_archive(
    last: int, config: dict[str, int], kept: str, reason: str
) -> None:
    entries = _chain(last, snapshot_every=2)
    plan = plan_retention(entries, RetentionConfig(**config), snapshot_every=2)
    left = [e for e in entries if e not in plan.remove]
    assert " ".join(f"{e.kind.value[0].upper()}{e.round}" for e in left) == kept
    assert reason in plan.reason


def test_what_is_left_always_restores_the_newest_version() -> None:
    entries = _chain(9, snapshot_every=3)
    plan = plan_retention(entries, RetentionConfig(keep_snapshots=2), snapshot_every=3)
    left = [e for e in entries if e not in plan.remove]
    newest = max(e.round for e in left if e.kind is S)
    updates = sorted(e.round for e in left if e.kind is U)
    assert newest == 9
    assert updates == [6, 7, 8]  # from the older kept snapshot (6) to θ_9


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"keep_snapshots": 0}, "greater than or equal to 1"),
        ({"keep_snapshots": 2, "keep_every": 1}, "greater than or equal to 2"),
        ({"keep_snapshots": "3"}, "valid integer"),
        ({}, "Field required"),
        ({"keep_snapshots": 2, "keep_last": 1}, "Extra inputs"),
    ],
)
def test_a_bad_retention_section_is_refused(config: dict[str, object], reason: str) -> None:
    with pytest.raises(ValidationError, match=reason):
        RetentionConfig.model_validate(config)
