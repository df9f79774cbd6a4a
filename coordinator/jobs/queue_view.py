"""What the queue and the usage gauges show, from the jobs' facts (pure).

The job manager keeps the queue (its admission passes decide it); these functions turn it
and the jobs' facts into the rows of ``GET /v1/queue`` and the figures of the scheduling
gauges: jobs waiting per priority class, GPUs held per team, the oldest wait per class and
the jobs waiting on their team's quota.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from coordinator.jobs.capacity import JobFacts, QueueEntry
from coordinator.rounds.records import JobState

__all__ = ["Listed", "QueueWaits", "gpus_held", "queue_rows", "queue_waits", "waiting_per_priority"]


@dataclass(frozen=True, slots=True)
class Listed:
    """A job as the queue shows it: its class and team (as its engine was given them),
    whether it states needs, and when it was submitted (None: not known)."""

    job: str
    state: JobState
    priority: str
    team: str
    scheduled: bool
    submitted_at: float | None
    #: What it will cost against its budget (:func:`coordinator.costs.estimate.outlook_json`).
    cost_estimate: dict[str, Any] | None = None


def queue_rows(
    jobs: Iterable[Listed], queue: Mapping[str, QueueEntry], now: float
) -> list[dict[str, Any]]:
    """The jobs waiting (in queue order, then by name) and running, as ``GET /v1/queue``
    shows them, each with its cost estimate; a job of unknown submission time is shown as
    submitted ``now``."""
    rows: list[dict[str, Any]] = []
    for each in jobs:
        if each.state is not JobState.QUEUED and each.state.final:
            continue
        entry = queue.get(each.job)
        since = now if each.submitted_at is None else each.submitted_at
        rows.append(
            {
                "job": each.job,
                "state": each.state.value,
                "priority": each.priority,
                "team": each.team,
                "position": entry.position if entry is not None else None,
                "reason": entry.reason if entry is not None else None,
                "submitted_at": datetime.fromtimestamp(since, UTC).isoformat(),
                "wait_s": round(max(0.0, now - since), 3) if entry is not None else None,
                "scheduled": each.scheduled,
                "cost_estimate": each.cost_estimate,
            }
        )
    rows.sort(key=lambda row: (row["position"] is None, row["position"] or 0, row["job"]))
    return rows


def waiting_per_priority(
    jobs: Iterable[Listed], queue: Mapping[str, QueueEntry], priorities: Iterable[str]
) -> dict[str, int]:
    """How many jobs wait in each priority class (every class of ``priorities`` listed)."""
    waiting = dict.fromkeys(priorities, 0)
    for each in jobs:
        if each.job in queue:
            waiting[each.priority] = waiting.get(each.priority, 0) + 1
    return waiting


def gpus_held(facts: Iterable[JobFacts], teams: Iterable[str]) -> dict[str, int]:
    """GPUs each team's running and paused jobs hold (every team of ``teams`` listed)."""
    held = dict.fromkeys(teams, 0)
    for each in facts:
        if each.state in (JobState.RUNNING, JobState.PAUSED):
            held[each.team] = held.get(each.team, 0) + sum(n.gpus for n in each.needs.values())
    return held


@dataclass(frozen=True, slots=True)
class QueueWaits:
    """The longest wait in seconds per priority class, and per team the jobs that wait
    because the team is at its quota."""

    oldest_s: dict[str, float]
    over_quota: dict[str, int]


def queue_waits(
    jobs: Mapping[str, Listed],
    queue: Mapping[str, QueueEntry],
    priorities: Iterable[str],
    teams: Iterable[str],
    now: float,
) -> QueueWaits:
    """The waits of the queued jobs (every class and team given listed, 0 if none waits)."""
    oldest = dict.fromkeys(priorities, 0.0)
    over_quota = dict.fromkeys(teams, 0)
    for job, entry in queue.items():
        listed = jobs[job]
        oldest[listed.priority] = max(oldest.get(listed.priority, 0.0), now - entry.since)
        if entry.over_quota:
            over_quota[listed.team] = over_quota.get(listed.team, 0) + 1
    return QueueWaits({p: max(0.0, w) for p, w in oldest.items()}, over_quota)
