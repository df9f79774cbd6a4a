"""The queue's rows and the scheduling gauges' figures, from the jobs' facts."""

from __future__ import annotations

from datetime import UTC, datetime

from coordinator.jobs.capacity import JobFacts, QueueEntry
from coordinator.jobs.queue_view import (
    Listed,
    gpus_held,
    queue_rows,
    queue_waits,
    waiting_per_priority,
)
from coordinator.rounds.records import JobState
from coordinator.scheduling.model import RegionNeed

NOW = 10_000.0


def listed(
    job: str,
    state: JobState,
    *,
    priority: str = "normal",
    team: str = "ml",
    submitted_at: float | None = 100.0,
) -> Listed:
    return Listed(job, state, priority, team, scheduled=True, submitted_at=submitted_at)


def facts(job: str, state: JobState, team: str, gpus: dict[str, int]) -> JobFacts:
    return JobFacts(
        name=job,
        state=state,
        priority="normal",
        team=team,
        regions=tuple(gpus),
        min_regions=1,
        needs={region: RegionNeed(gpus=n) for region, n in gpus.items()},
        submitted_at=0.0,
    )


def test_rows_put_waiting_jobs_in_queue_order_then_the_others_by_name() -> None:
    jobs = [
        listed("zeta", JobState.RUNNING),
        listed("beta", JobState.QUEUED),
        listed("alpha", JobState.QUEUED),
        listed("done", JobState.COMPLETED),
        listed("gone", JobState.CANCELLED),
        listed("held", JobState.PAUSED),
    ]
    queue = {"beta": QueueEntry(1, "next", 900.0), "alpha": QueueEntry(2, "after beta", 950.0)}
    rows = queue_rows(jobs, queue, NOW)
    assert [r["job"] for r in rows] == ["beta", "alpha", "held", "zeta"]
    beta, _, held, _ = rows
    assert (beta["position"], beta["reason"], beta["wait_s"]) == (1, "next", NOW - 100.0)
    assert beta["submitted_at"] == datetime.fromtimestamp(100.0, UTC).isoformat()
    assert (held["position"], held["reason"], held["wait_s"]) == (None, None, None)
    assert held["state"] == "paused"


def test_a_job_of_unknown_submission_time_is_shown_as_submitted_now() -> None:
    rows = queue_rows(
        [listed("new", JobState.QUEUED, submitted_at=None)],
        {"new": QueueEntry(1, "next", NOW)},
        NOW,
    )
    assert rows[0]["submitted_at"] == datetime.fromtimestamp(NOW, UTC).isoformat()
    assert rows[0]["wait_s"] == 0.0


def test_waiting_jobs_are_counted_per_class_with_every_class_listed() -> None:
    jobs = [
        listed("a", JobState.QUEUED, priority="high"),
        listed("b", JobState.QUEUED, priority="high"),
        listed("c", JobState.RUNNING, priority="low"),
        listed("d", JobState.QUEUED, priority="retired"),
    ]
    queue = {j: QueueEntry(i + 1, "waits", 0.0) for i, j in enumerate(("a", "b", "d"))}
    assert waiting_per_priority(jobs, queue, ("high", "normal", "low")) == {
        "high": 2,
        "normal": 0,
        "low": 0,
        "retired": 1,
    }


def test_gpus_are_held_by_running_and_paused_jobs_only() -> None:
    held = gpus_held(
        [
            facts("a", JobState.RUNNING, "ml", {"eu": 4, "us": 2}),
            facts("b", JobState.PAUSED, "ml", {"eu": 1}),
            facts("c", JobState.QUEUED, "ml", {"eu": 8}),
            facts("d", JobState.COMPLETED, "infra", {"eu": 8}),
            facts("e", JobState.RUNNING, "vision", {"us": 3}),
        ],
        ("ml", "infra", "default"),
    )
    assert held == {"ml": 7, "infra": 0, "default": 0, "vision": 3}


def test_waits_are_the_oldest_per_class_and_the_quota_bound_per_team() -> None:
    jobs = {
        "a": listed("a", JobState.QUEUED, priority="high", team="ml"),
        "b": listed("b", JobState.QUEUED, priority="high", team="ml"),
        "c": listed("c", JobState.QUEUED, priority="low", team="vision"),
    }
    queue = {
        "a": QueueEntry(1, "next", NOW - 30.0),
        "b": QueueEntry(2, "quota", NOW - 300.0, over_quota=True),
        # A clock stepped back: a wait is never negative.
        "c": QueueEntry(3, "later", NOW + 5.0),
    }
    waits = queue_waits(jobs, queue, ("high", "normal", "low"), ("ml", "vision", "infra"), NOW)
    assert waits.oldest_s == {"high": 300.0, "normal": 0.0, "low": 0.0}
    assert waits.over_quota == {"ml": 1, "vision": 0, "infra": 0}
