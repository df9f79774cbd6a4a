"""The snapshot policy: the spec's settings, the chosen interval, each round's decision,
irregular snapshot rounds in retention and the preemption window (pure, table-driven)."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.jobs.capacity import training_phase
from coordinator.jobs.spec import JobSpecError, parse_job_spec, parse_stored_spec
from coordinator.publication.snapshot_policy import (
    SnapshotPlan,
    SnapshotSettings,
    SnapshotStats,
    decide_snapshot,
    load_stats,
    next_snapshot_round,
    plan_interval,
    save_stats,
    snapshot_status,
)
from coordinator.publication.snapshots import JobSnapshots
from coordinator.scheduling.hardware_risk import Risk
from coordinator.storage.checkpoints import CheckpointEntry, EntryKind
from coordinator.storage.retention import RetentionConfig, plan_retention
from geofed_cli.jobs import _print_job

SPEC = """\
job: tiny
task:
  spec: tests.support.tiny_task:TinyTask
regions:
  eu-west: [eu-parliament-proceedings]
  us-east: [us-public-domain-books]
rounds: 3
inner_steps: 2
checkpoint_storage: [eu-ckpt]
"""

REGIONS = ("eu-west", "us-east")
AUTO = SnapshotSettings(None, min_rounds=2, max_rounds=20)


def _problems(text: str) -> tuple[str, ...]:
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(text, "job.yaml")
    return caught.value.problems


# -- the job spec -----------------------------------------------------------------------


def test_a_spec_stays_fixed_at_10_unless_it_says_auto() -> None:
    spec = parse_job_spec(SPEC, "job.yaml")
    assert (spec.snapshot_every, spec.fixed_snapshot_every) == (10, 10)
    assert SnapshotSettings.of(spec) == SnapshotSettings(10, 1, 100)
    assert SnapshotSettings.of(spec).mode == "fixed"

    text = SPEC + "snapshot_every: auto\nsnapshot_min_rounds: 3\nsnapshot_max_rounds: 40\n"
    auto = parse_job_spec(text, "job.yaml")
    assert auto.fixed_snapshot_every is None
    assert SnapshotSettings.of(auto) == SnapshotSettings(None, 3, 40)
    assert parse_stored_spec(json.loads(json.dumps(auto.to_json()))) == auto


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("snapshot_every: often\n", "job.yaml:10: snapshot_every: "),
        ("snapshot_every: 0\n", "snapshot_every must be a whole number in 1..10000000 or auto"),
        ("snapshot_every: true\n", "snapshot_every: "),
        ("snapshot_min_rounds: 0\n", "job.yaml:10: snapshot_min_rounds: "),
        (
            "snapshot_every: auto\nsnapshot_min_rounds: 5\nsnapshot_max_rounds: 2\n",
            "job.yaml:12: snapshot_max_rounds: ",
        ),
    ],
)
def test_bad_snapshot_settings_name_the_key(extra: str, expected: str) -> None:
    problems = _problems(SPEC + extra)
    assert any(expected in problem for problem in problems), problems


def test_bounds_out_of_order_say_so() -> None:
    text = SPEC + "snapshot_every: auto\nsnapshot_min_rounds: 5\nsnapshot_max_rounds: 2\n"
    assert "snapshot_max_rounds (2) is below snapshot_min_rounds (5)" in _problems(text)[0]


# -- the interval ------------------------------------------------------------------------


def _stats(
    cost: float | None = None,
    round_s: float | None = None,
    failures: dict[str, int] | None = None,
    exposure: float = 0.0,
) -> SnapshotStats:
    stats = SnapshotStats()
    if cost is not None:
        stats.snapshot_took(cost)
    if round_s is not None:
        stats.round_took(round_s, ())
    for region in REGIONS:
        stats.exposure_s[region] = exposure
    for region, count in (failures or {}).items():
        for _ in range(count):
            stats.region_failed(region, "went offline")
    return stats


@pytest.mark.parametrize(
    ("settings", "stats", "round_s", "every", "tau", "reason"),
    [
        # Fixed: K, whatever was measured.
        (
            SnapshotSettings(5),
            _stats(2.0, 10.0, {"eu-west": 1}, 100.0),
            10.0,
            5,
            None,
            "snapshot_every: 5",
        ),
        # Auto, nothing measured: the shortest interval, to measure a snapshot's cost.
        (AUTO, _stats(), 10.0, 2, None, "no snapshot cost measured yet"),
        (AUTO, _stats(cost=1.0), None, 2, None, "no round duration measured yet"),
        # Cost known, no failure seen: the longest interval.
        (AUTO, _stats(1.0, 10.0), 10.0, 20, None, "no failures measured yet"),
        # One failure of eu-west in 800 s: M = 800 s, τ = √(2·1·800) = 40 s = 4 rounds.
        (AUTO, _stats(1.0, 10.0, {"eu-west": 1}, 800.0), 10.0, 4, 40.0, "measured MTBF 800 s"),
        # Both regions failed once in 1600 s: M = 800 s again (1/M = 2/1600).
        (
            AUTO,
            _stats(1.0, 10.0, {"eu-west": 1, "us-east": 1}, 1600.0),
            10.0,
            4,
            40.0,
            "us-east: 1 in 1600 s",
        ),
        # Failures so frequent that τ is under a round: the job's minimum.
        (
            AUTO,
            _stats(0.5, 10.0, {"eu-west": 10}, 100.0),
            10.0,
            2,
            math.sqrt(10.0),
            "raised to the job's minimum 2",
        ),
        # So rare and snapshots so costly that τ passes the maximum.
        (
            AUTO,
            _stats(500.0, 10.0, {"eu-west": 1}, 1e6),
            10.0,
            20,
            math.sqrt(1e9),
            "lowered to the job's maximum 20",
        ),
    ],
)
def test_plan_interval(
    settings: SnapshotSettings,
    stats: SnapshotStats,
    round_s: float | None,
    every: int,
    tau: float | None,
    reason: str,
) -> None:
    plan = plan_interval(settings, stats, REGIONS, round_s)
    assert plan.every_rounds == every
    assert plan.tau_s == (None if tau is None else pytest.approx(tau))
    assert reason in plan.reason, plan.reason
    assert plan.mode == settings.mode
    assert plan.cost_s == stats.cost_s


def test_the_means_are_running_means_and_exposure_is_per_region() -> None:
    stats = SnapshotStats()
    stats.snapshot_took(1.0)
    stats.snapshot_took(3.0)
    stats.round_took(10.0, ["eu-west"])
    stats.round_took(20.0, ["eu-west", "us-east"])
    assert (stats.cost_s, stats.round_s) == (2.0, 15.0)
    assert stats.exposure_s == {"eu-west": 30.0, "us-east": 20.0}
    stats.region_failed("us-east", "went offline")
    assert stats.mtbf_s(REGIONS) == 20.0  # eu-west has no failure: it adds no rate
    stats.region_failed("eu-west", "missed the deadline of round 1")
    assert stats.mtbf_s(REGIONS) == pytest.approx(1 / (1 / 30 + 1 / 20))


# -- each round's decision ---------------------------------------------------------------

FIXED_5 = SnapshotPlan("fixed", 5, None, "snapshot_every: 5", None, None)
AUTO_4 = SnapshotPlan("auto", 4, 40.0, "Young/Daly", 1.0, 800.0)


@pytest.mark.parametrize(
    ("version", "last", "plan", "take", "reason", "next_round"),
    [
        # Fixed: multiples of K, as ever (also after a restart, whatever the chain holds).
        (5, 0, FIXED_5, True, "round 5 is a multiple of 5", 10),
        (6, 5, FIXED_5, False, "round 6 is not a multiple of 5", 10),
        (10, None, FIXED_5, True, "multiple of 5", 15),
        # Auto: once the rounds since the newest snapshot reach the interval.
        (3, 0, AUTO_4, False, "3 round(s) since the snapshot of round 0, below 4", 4),
        (4, 0, AUTO_4, True, "4 round(s) since the snapshot of round 0: interval 4", 8),
        (9, 3, AUTO_4, True, "6 round(s) since the snapshot of round 3", 13),
        (1, None, AUTO_4, True, "no snapshot in the job's chain", 5),
    ],
)
def test_decide_snapshot(
    version: int, last: int | None, plan: SnapshotPlan, take: bool, reason: str, next_round: int
) -> None:
    decision = decide_snapshot(version, last, plan)
    assert decision.take is take
    assert reason in decision.reason
    # Once θ_version is published (and snapshotted if taken), the next planned one:
    newest = version if take else last
    assert next_snapshot_round(version, newest, plan) == next_round


def test_the_status_object_says_mode_interval_reason_and_rounds() -> None:
    assert snapshot_status(AUTO_4, 6, 3) == {
        "mode": "auto",
        "every_rounds": 4,
        "tau_s": 40.0,
        "reason": "Young/Daly",
        "last_round": 3,
        "next_round": 7,
        "cost_s": 1.0,
        "mtbf_s": 800.0,
        "risk": None,
    }
    risky = snapshot_status(AUTO_4, 6, 3, Risk(0.8, "eu-west: ecc"))["risk"]
    assert risky == {"score": 0.8, "reason": "eu-west: ecc"}
    # The interval shrank below the rounds already run: the next publication takes one.
    assert snapshot_status(AUTO_4, 9, 3)["next_round"] == 10


# -- measurements survive a restart ------------------------------------------------------


def test_stats_are_saved_and_loaded(tmp_path: Path) -> None:
    stats = _stats(1.5, 12.0, {"eu-west": 2}, 300.0)
    path = tmp_path / "policy" / "job.json"
    save_stats(path, stats)
    assert load_stats(path) == stats
    assert load_stats(tmp_path / "none.json") == SnapshotStats()
    stats.failed_at["eu-west"] = [1_800_000_000.0]
    stats.drained.add("eu-west")
    save_stats(path, stats)
    assert load_stats(path) == stats
    # A file of a coordinator before failures and drains were saved still loads.
    older = {k: v for k, v in stats.to_json().items() if k not in ("failed_at", "drained")}
    path.write_text(json.dumps(older))
    assert load_stats(path) == _stats(1.5, 12.0, {"eu-west": 2}, 300.0)


@pytest.mark.parametrize(
    "content",
    [
        b"{",
        b"[]",
        b'{"cost_s_sum": 1}',
        json.dumps({**_stats(1.0).to_json(), "cost_count": -1}).encode(),
        json.dumps({**_stats(1.0).to_json(), "failed_at": {"eu-west": [-1.0]}}).encode(),
        json.dumps({**_stats(1.0).to_json(), "drained": "eu-west"}).encode(),
    ],
)
def test_unreadable_stats_are_measured_afresh(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "job.json"
    path.write_bytes(content)
    assert load_stats(path) == SnapshotStats()


# -- irregular snapshot rounds elsewhere -------------------------------------------------


def _entry(kind: EntryKind, round_: int) -> CheckpointEntry:
    digest = f"{round_ + (0 if kind is EntryKind.SNAPSHOT else 500):064x}"
    return CheckpointEntry(kind, round_, digest, "a" * 64, 0.0)


def _names(entries: list[CheckpointEntry]) -> str:
    return " ".join(f"{e.kind.value[0].upper()}{e.round}" for e in entries)


def test_retention_of_irregular_snapshots_keeps_its_archive_as_pruning_goes_on() -> None:
    """Snapshots at 0, 3, 4, 9, 11, 16, 17, 25; archives: the first of every 2 x 4 rounds."""
    config = RetentionConfig(keep_snapshots=1, keep_every=2)
    chain: list[CheckpointEntry] = []
    archives: list[str] = []
    snapshots = (0, 3, 4, 9, 11, 16, 17, 25)
    for version in range(26):
        if version:
            chain.append(_entry(EntryKind.UPDATE, version - 1))
        if version in snapshots:
            chain.append(_entry(EntryKind.SNAPSHOT, version))
            plan = plan_retention(chain, config, snapshot_every=4)
            chain = [e for e in chain if e not in plan.remove]
            archives.append(_names(chain))
    # Spans of 8 rounds: [0, 8) -> 0, [8, 16) -> 9, [16, 24) -> 16, [24, 32) -> 25.
    assert archives[-1] == "S0 S9 S16 S25"
    # An archived snapshot, once chosen, stays through every later pass.
    assert archives[4] == "S0 S9 S11"
    assert all("S0" in kept for kept in archives)
    assert all("S9" in kept for kept in archives[3:])


@pytest.mark.parametrize(
    ("version", "every", "last", "next_", "since", "to"),
    [
        (7, 5, None, None, 2, 3),  # regular: from multiples of K, as before
        (7, 4, 3, 7 + 1, 4, 1),  # irregular: the next publication takes it
        (7, 6, 5, 11, 2, 4),  # the plan's next snapshot
        (7, 6, 5, None, 2, 4),  # without a plan: last + every
    ],
)
def test_the_training_phase_counts_from_the_actual_snapshots(
    version: int, every: int, last: int | None, next_: int | None, since: int, to: int
) -> None:
    phase = training_phase(version, every, in_round=False, last_snapshot=last, next_snapshot=next_)
    assert (phase.rounds_since_snapshot, phase.rounds_to_snapshot) == (since, to)


def test_geofed_job_status_prints_the_snapshot_plan() -> None:
    body = {
        "job": "tiny",
        "state": "running",
        "round": 6,
        "rounds": 10,
        "checkpoint_location": "eu-ckpt",
        "params_hash": "ab",
        "snapshot": snapshot_status(AUTO_4, 6, 3),
    }
    out = io.StringIO()
    _print_job(body, out)
    assert "snapshots (auto) every 4 round(s), last θ_3, next θ_7: Young/Daly" in out.getvalue()


class _Gauge:
    """A stand-in for the interval gauge: the last value set."""

    def __init__(self) -> None:
        self.value: float | None = None

    def labels(self, **_: str) -> _Gauge:
        return self

    def set(self, value: float) -> None:
        self.value = value


def test_a_stored_snapshot_replans_at_once_so_the_status_never_shows_it_without_its_cost(
    tmp_path: Path,
) -> None:
    """Between a snapshot stored and its round's publication ending, the job's status
    shows the plan the measured cost makes, not the first plan that had none."""
    spec = parse_job_spec(
        SPEC + "snapshot_every: auto\nsnapshot_min_rounds: 2\nsnapshot_max_rounds: 4\n", "job.yaml"
    )
    gauge = _Gauge()
    services: Any = SimpleNamespace(
        config=SimpleNamespace(state_dir=tmp_path),
        control=SimpleNamespace(
            regions={}, ecc_first_seen={}, last_hardware={}, on_region_change=lambda _: None
        ),
        metrics=SimpleNamespace(snapshot_interval=gauge),
        clock=lambda: 100.0,
    )
    ctx: Any = SimpleNamespace(job="tiny", spec=spec)
    snapshots = JobSnapshots(services, ctx, serving=lambda _: True, losses={})
    snapshots.stats.round_took(10.0, spec.regions)
    rs: Any = SimpleNamespace(config=SimpleNamespace(round=1, opened_at=90.0), ended_at=100.0)
    assert snapshots.decide(rs).take
    assert snapshots.every_rounds == 2
    snapshots.stored(2, 0.5)
    status = snapshots.status(2)
    assert (status["last_round"], status["every_rounds"]) == (2, 4), status
    assert "no snapshot cost measured yet" not in status["reason"], status
    assert gauge.value == 4
