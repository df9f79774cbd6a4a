"""The validation loss's trend and the snapshot interval it stretches (pure)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.jobs.spec import parse_job_spec
from coordinator.publication.loss_trend import STRETCH, loss_trend
from coordinator.publication.snapshot_policy import SnapshotSettings, SnapshotStats, plan_interval
from coordinator.publication.snapshots import JobSnapshots

FALLING = {1: 3.0, 2: 2.8, 3: 2.7, 4: 2.65, 5: 2.6}


@pytest.mark.parametrize(
    ("history", "stretch", "reason"),
    [
        ({}, 1, "0 evaluated round(s), 4 tell a trend"),
        ({1: 3.0, 2: 2.9, 3: 2.8}, 1, "3 evaluated round(s), 4 tell a trend"),
        (FALLING, STRETCH, "the validation loss falls steadily (3 -> 2.6 over rounds 1-5)"),
        # Only the newest five count: an early rise is forgotten.
        ({0: 2.0, **FALLING}, STRETCH, "falls steadily (3 -> 2.6 over rounds 1-5)"),
        # A rise within the noise (1 %) is no rise.
        ({1: 3.0, 2: 2.8, 3: 2.82, 4: 2.7}, STRETCH, "falls steadily (3 -> 2.7 over rounds 1-4)"),
        ({1: 3.0, 2: 2.8, 3: 2.9, 4: 2.7}, 1, "rose from 2.8 (round 2) to 2.9 (round 3)"),
        ({1: 3.0, 2: 3.0, 3: 2.995, 4: 2.99}, 1, "stayed near 3 over rounds 1-4"),
        ({1: 3.0, 2: 2.8, 3: math.nan, 4: 2.7}, 1, "a non-finite validation loss in rounds 1-4"),
    ],
)
def test_the_trend_says_why(history: dict[int, float], stretch: int, reason: str) -> None:
    trend = loss_trend(history)
    assert trend.stretch == stretch
    assert reason in trend.reason


def _stats(region: str = "eu") -> SnapshotStats:
    """A measured snapshot cost, round duration and one failure: an auto plan of its own."""
    stats = SnapshotStats()
    stats.snapshot_took(2.0)
    stats.round_took(10.0, [region])
    stats.region_failed(region, "went offline")
    return stats


def _plan(history: dict[int, float], every: int | None = None, high: int = 100) -> Any:
    settings = SnapshotSettings(every, 1, high)
    return plan_interval(settings, _stats(), ["eu"], 10.0, loss_trend(history))


def test_a_steadily_falling_loss_stretches_a_measured_auto_interval() -> None:
    base = plan_interval(SnapshotSettings(None, 1, 100), _stats(), ["eu"], 10.0)
    stretched = _plan(FALLING)
    assert stretched.every_rounds == base.every_rounds * STRETCH > 1
    assert (
        f"({base.every_rounds} -> {stretched.every_rounds} rounds) while the validation loss"
        in (stretched.reason)
    )
    rising = _plan({1: 3.0, 2: 2.8, 3: 2.9, 4: 2.7})
    assert rising.every_rounds == base.every_rounds
    assert "not stretched: the validation loss rose" in rising.reason


def test_the_stretch_keeps_to_the_bounds_and_leaves_fixed_and_unmeasured_plans_alone() -> None:
    base = plan_interval(SnapshotSettings(None, 1, 100), _stats(), ["eu"], 10.0)
    capped = _plan(FALLING, high=base.every_rounds)
    assert capped.every_rounds == base.every_rounds
    assert "at snapshot_max_rounds already while the validation loss falls" in capped.reason
    assert _plan(FALLING, every=7).every_rounds == 7
    unmeasured = plan_interval(
        SnapshotSettings(None, 3, 100), SnapshotStats(), ["eu"], None, loss_trend(FALLING)
    )
    assert unmeasured.every_rounds == 3, "the first snapshot measures its cost, soon"


def test_the_job_replans_with_the_losses_its_evaluation_keeps(tmp_path: Path) -> None:
    """JobSnapshots reads the live loss history: a loss that starts falling steadily
    stretches the interval at the next plan, one that rises shrinks it back."""
    spec = parse_job_spec(
        "job: tiny\ntask:\n  spec: tests.support.tiny_task:TinyTask\nregions:\n"
        "  eu-west: [eu-parliament-proceedings]\nsnapshot_every: auto\n"
        "snapshot_max_rounds: 50\nrounds: 20\ninner_steps: 2\ncheckpoint_storage: [eu-ckpt]\n",
        "job.yaml",
    )
    services: Any = SimpleNamespace(
        config=SimpleNamespace(state_dir=tmp_path),
        control=SimpleNamespace(
            regions={}, ecc_first_seen={}, last_hardware={}, on_region_change=lambda _: None
        ),
        metrics=SimpleNamespace(
            snapshot_interval=SimpleNamespace(labels=lambda **_: SimpleNamespace(set=print))
        ),
        clock=lambda: 100.0,
    )
    losses: dict[int, float] = {}
    ctx: Any = SimpleNamespace(job="tiny", spec=spec)
    snapshots = JobSnapshots(services, ctx, lambda _: True, losses)
    snapshots.stats = _stats("eu-west")
    rs: Any = SimpleNamespace(config=SimpleNamespace(round=5, opened_at=90.0), ended_at=100.0)
    snapshots.decide(rs)
    plain = snapshots.every_rounds
    losses.update(FALLING)
    snapshots.decide(rs)
    assert snapshots.every_rounds == plain * STRETCH
    assert "falls steadily" in snapshots.status(5)["reason"]
    losses[6] = 3.5
    snapshots.decide(rs)
    assert snapshots.every_rounds == plain
    assert "rose from 2.6 (round 5) to 3.5 (round 6)" in snapshots.status(6)["reason"]
