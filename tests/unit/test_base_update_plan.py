"""When rank 0 makes θ from the θ the group holds and the round's update, and when it reads
θ whole (:func:`regional_agent.worker.base_update.planned_update`): only the next round
of the same job, from a chain that is the held one and one update more, from the same
base file, with the hash the agent verified."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from geofed.theta_chain import StoredUpdate, ThetaChain
from regional_agent.worker.base_update import HeldBase, held_base, planned_updates
from tests.support.worker_group import instruction


def _update(round_: int, tag: str, root: Path) -> StoredUpdate:
    return StoredUpdate(round_, root / f"update-{round_}", 0, (10, 20, 5), (tag, tag, tag))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "theta-4.st").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    ThetaChain(tmp_path / "theta-4.st", 4, (_update(4, "a", tmp_path),)).save(
        tmp_path / "round-5.json"
    )
    ThetaChain(
        tmp_path / "theta-4.st", 4, (_update(4, "a", tmp_path), _update(5, "b", tmp_path))
    ).save(tmp_path / "round-6.json")
    return tmp_path


def _held(root: Path, round_: int = 5, job: str = "job-a") -> HeldBase:
    step = instruction(job, round_, root / f"round-{round_}.json", base_hash="h5")
    return held_base(step, "h5", 0)


def test_the_next_round_of_a_chain_one_update_longer_applies_that_update(root: Path) -> None:
    step = instruction("job-a", 6, root / "round-6.json", base_hash="h6")
    assert planned_updates(_held(root), step) == (_update(5, "b", root),)
    # The other ranks record no chain: only rank 0 plans.
    assert held_base(step, "h6", 1).chain is None


def test_a_region_that_sat_out_rounds_applies_every_update_since_in_order(root: Path) -> None:
    updates = tuple(_update(r, tag, root) for r, tag in ((4, "a"), (5, "b"), (6, "c")))
    ThetaChain(root / "theta-4.st", 4, updates).save(root / "round-7.json")
    step = instruction("job-a", 7, root / "round-7.json", base_hash="h7")
    assert planned_updates(_held(root), step) == updates[1:]
    # A chain shorter than the rounds since (θ written whole at round 6, then round 6's
    # update) does not follow the held θ.
    (root / "theta-6.st").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    ThetaChain(root / "theta-6.st", 6, (updates[2],)).save(root / "short.json")
    short = instruction("job-a", 7, root / "short.json", base_hash="h7")
    assert planned_updates(_held(root), short) is None


def test_theta_is_read_whole_when_the_round_does_not_follow_what_the_group_holds(
    root: Path,
) -> None:
    step = instruction("job-a", 6, root / "round-6.json", base_hash="h6")
    assert planned_updates(None, step) is None
    assert planned_updates(_held(root, job="job-b"), step) is None
    # A redo of the round held, or a chain of another round than the instruction's.
    redo = instruction("job-a", 5, root / "round-5.json", base_hash="h5")
    assert planned_updates(_held(root), redo) is None
    skewed = instruction("job-a", 7, root / "round-6.json", base_hash="h7")
    assert planned_updates(_held(root), skewed) is None
    # No hash from the agent: the workers could not say what they trained from.
    assert planned_updates(_held(root), instruction("job-a", 6, root / "round-6.json")) is None


def test_theta_is_read_whole_after_the_agent_wrote_it_or_changed_its_chain(root: Path) -> None:
    held = _held(root)
    # θ_6 written whole: a θ file, no update to apply.
    (root / "theta-6.st").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    whole = instruction("job-a", 6, root / "theta-6.st", base_hash="h6")
    assert planned_updates(held, whole) is None
    # Another round 4 update before round 5's (a resync onto another lineage).
    ThetaChain(root / "theta-4.st", 4, (_update(4, "x", root), _update(5, "b", root))).save(
        root / "other.json"
    )
    other = instruction("job-a", 6, root / "other.json", base_hash="h6")
    assert planned_updates(held, other) is None
    # The base file written anew at the same place.
    step = instruction("job-a", 6, root / "round-6.json", base_hash="h6")
    base = root / "theta-4.st"
    stat = base.stat()
    os.utime(base, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert planned_updates(held, step) is None
    # A chain that cannot be read.
    (root / "round-6.json").write_text("{")
    assert planned_updates(_held(root), step) is None
