"""Capacity admission: the coordinator's facts in, the scheduler's decisions out.

Pure (the time passed in, no I/O): :func:`admission_pass` turns what the coordinator
knows (each region's reported capacity and whether it is up, each job's needs, priority,
team and state) into one pass of :func:`coordinator.scheduling.plan`: which queued jobs
start now, and, for each job left waiting, its place in the queue and why it waits.
The job manager carries the decisions out (:mod:`coordinator.jobs.manager`).

Rules that keep what worked before working:

* a job whose spec states no ``needs`` is not capacity-scheduled: it starts at once and
  holds nothing (it shares its regions' workers, as every job did before);
* a region whose agent reports no capacity (an agent that predates it) has unknown
  capacity, treated as unlimited (and of any GPU kind);
* a region with no live status (never heard of, or its Last Will) is down: a job that
  needs it waits;
* a started job holds its need in every one of its regions (its rounds take them all)
  while it runs or is paused;
* a waiting job of a higher class may preempt running ones (as the scheduling config
  allows, :mod:`coordinator.scheduling.preemption`): they stop at their next round
  boundary (``Pass.preempt``), never within the snapshot window, and the capacity they
  free is held for it (``Pass.claims``, passed back as ``JobFacts.claim``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from coordinator.jobs.spec import JobSpec, NeedSpec
from coordinator.rounds.records import JobState
from coordinator.scheduling import (
    Blocker,
    Job,
    Region,
    RegionCapacity,
    RegionNeed,
    RunInterval,
    SchedulingConfig,
    SchedulingState,
    TrainingPhase,
    plan,
)
from coordinator.scheduling.elastic import join_shortfall
from geofed.control import Capacity

__all__ = [
    "UNLIMITED",
    "JobFacts",
    "Pass",
    "QueueEntry",
    "RegionFacts",
    "Start",
    "admission_pass",
    "capacity_json",
    "in_use",
    "job_facts",
    "join_capacity_refusal",
    "training_phase",
    "without_preemption",
]

#: The GPUs and worker slots of a region whose capacity is unknown.
UNLIMITED = 2**31
#: Job states that hold their regions' capacity.
HOLDING = frozenset({JobState.RUNNING, JobState.PAUSED})


@dataclass(frozen=True, slots=True)
class RegionFacts:
    """A region as its last status shows it; ``capacity`` None: unknown."""

    name: str
    up: bool
    capacity: Capacity | None


@dataclass(frozen=True, slots=True)
class JobFacts:
    """What admission needs of one job; ``needs`` empty: not capacity-scheduled."""

    name: str
    state: JobState
    priority: str
    team: str
    regions: tuple[str, ...]
    min_regions: int
    needs: Mapping[str, RegionNeed]
    submitted_at: float
    phase: TrainingPhase | None = None  # a running job's, for preemption
    preempting: bool = False  # asked to stop at its next boundary
    claim: tuple[str, ...] = ()  # regions being freed for it (a previous Pass.claims)

    @property
    def scheduled(self) -> bool:
        return bool(self.needs)


@dataclass(frozen=True, slots=True)
class QueueEntry:
    """A waiting job's place in the queue (1 is next), why it waits, since when."""

    position: int
    reason: str
    since: float
    over_quota: bool = False  # waits because its team is at its quota

    def as_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "reason": self.reason,
            "since": datetime.fromtimestamp(self.since, UTC).isoformat(),
        }


@dataclass(frozen=True, slots=True)
class Start:
    """A queued job that starts now, on which regions' capacity, and why."""

    job: str
    regions: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Pass:
    """One admission pass: the jobs to start and the queue of those left waiting;
    ``preempt``: running job -> why it is to stop at its next boundary; ``claims``:
    waiting job -> the regions its victims are freeing for it."""

    starts: tuple[Start, ...]
    queue: Mapping[str, QueueEntry]
    preempt: Mapping[str, str] = dataclasses.field(default_factory=dict)
    claims: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


def training_phase(
    version: int,
    snapshot_every: int,
    *,
    in_round: bool,
    last_snapshot: int | None = None,
    next_snapshot: int | None = None,
) -> TrainingPhase:
    """Where a job at θ_version stands between snapshots; ``in_round``: a round of it is
    under way. ``last_snapshot`` and ``next_snapshot`` are the versions of its newest
    snapshot and of the one its plan takes next (:mod:`coordinator.publication.snapshot_policy`);
    without them, snapshots are at every multiple of ``snapshot_every``."""
    last = version - version % snapshot_every if last_snapshot is None else last_snapshot
    since = max(0, version - last)
    upcoming = last + snapshot_every if next_snapshot is None else next_snapshot
    return TrainingPhase(
        rounds_since_snapshot=since,
        rounds_to_snapshot=max(1, upcoming - version),
        round_in_progress=in_round,
    )


def job_facts(
    spec: JobSpec,
    state: JobState,
    submitted_at: float,
    config: SchedulingConfig,
    *,
    phase: TrainingPhase | None = None,
    preempting: bool = False,
    claim: tuple[str, ...] = (),
) -> JobFacts:
    """The admission facts of a job; a priority class the config lacks is its default."""
    priority = spec.priority or config.default_priority
    if priority not in config.priorities:
        priority = config.default_priority  # the class was removed from the config since
    needs: dict[str, RegionNeed] = {}
    for region in spec.regions:
        need = spec.need_in(region)
        if need is not None:
            needs[region] = _need(need)
    return JobFacts(
        name=spec.job,
        state=state,
        priority=priority,
        team=spec.team_name,
        regions=tuple(spec.regions),
        min_regions=spec.quorum,
        needs=needs,
        submitted_at=submitted_at,
        phase=phase,
        preempting=preempting,
        claim=claim,
    )


def _need(need: NeedSpec) -> RegionNeed:
    return RegionNeed(
        gpus=need.gpus,
        gpu_kind=need.gpu_kind,
        min_gpu_memory_gib=need.min_gpu_memory_gib,
        cpu_slots=need.cpu_slots,
    )


def without_preemption(config: SchedulingConfig) -> SchedulingConfig:
    """``config`` with preemption off (jobs are not stopped to make room yet)."""
    preemption = config.preemption.model_copy(update={"enabled": False})
    return config.model_copy(update={"preemption": preemption})


def admission_pass(
    now: float,
    regions: Sequence[RegionFacts],
    jobs: Sequence[JobFacts],
    config: SchedulingConfig,
    intervals: Iterable[RunInterval] = (),
) -> Pass:
    """Which queued jobs start at ``now``, and the queue of those that wait, with why;
    ``intervals``: when each team's jobs held GPUs (for GPU-hour quotas)."""
    unknown = frozenset(region.name for region in regions if region.capacity is None)
    scheduled = [
        _job(facts, unknown)
        for facts in jobs
        if facts.scheduled and (facts.state is JobState.QUEUED or facts.state in HOLDING)
    ]
    decided = plan(now, [_region(region) for region in regions], scheduled, config, intervals)
    since = {facts.name: facts.submitted_at for facts in jobs}
    starts = tuple(Start(a.job, a.regions, a.reason) for a in decided.admitted)
    queue = {
        wait.job: QueueEntry(position, wait.reason, since[wait.job], wait.blocker is Blocker.QUOTA)
        for position, wait in enumerate(decided.waiting, start=1)
    }
    preempt = {victim.job: victim.reason for victim in decided.preempted}
    claims = {wait.job: wait.claim for wait in decided.waiting if wait.claim}
    return Pass(starts, queue, preempt, claims)


def _region(facts: RegionFacts) -> Region:
    capacity = facts.capacity
    if capacity is None:
        offered = RegionCapacity(gpus=UNLIMITED, gpu_memory_gib=float("inf"), cpu_slots=UNLIMITED)
    else:
        offered = RegionCapacity(
            gpus=capacity.gpus,
            gpu_kind=capacity.gpu_kind,
            gpu_memory_gib=capacity.gpu_memory_gib,
            cpu_slots=capacity.cpu_slots,
        )
    return Region(facts.name, offered, up=facts.up)


def _job(facts: JobFacts, unknown: frozenset[str]) -> Job:
    # A region of unknown capacity runs any kind of GPU: its need loses its kind.
    needs = {
        region: dataclasses.replace(need, gpu_kind=None) if region in unknown else need
        for region, need in facts.needs.items()
    }
    holding = facts.state in HOLDING
    if facts.state is JobState.RUNNING and facts.preempting:
        state = SchedulingState.PREEMPTING
    else:
        state = SchedulingState.RUNNING if holding else SchedulingState.QUEUED
    first = next(iter(needs.values()))
    return Job(
        name=facts.name,
        team=facts.team,
        priority=facts.priority,
        submitted_at=facts.submitted_at,
        regions=facts.regions,
        need=first,
        min_regions=min(facts.min_regions, len(facts.regions)),
        needs=needs,
        state=state,
        placement=facts.regions if holding else (),
        phase=facts.phase if holding else None,
        claim=facts.claim if not holding else (),
    )


def join_capacity_refusal(
    region: str,
    need: NeedSpec,
    regions: Sequence[RegionFacts],
    jobs: Sequence[JobFacts],
) -> str | None:
    """Why a job needing ``need`` cannot join ``region`` now (what the running and paused
    capacity-scheduled ``jobs`` hold there is not free), or None when it fits."""
    facts = next((each for each in regions if each.name == region), None)
    unknown = frozenset(each.name for each in regions if each.capacity is None)
    holding = [_job(each, unknown) for each in jobs if each.scheduled and each.state in HOLDING]
    wanted = _need(need)
    if region in unknown:
        wanted = dataclasses.replace(wanted, gpu_kind=None)
    return join_shortfall(wanted, _region(facts) if facts is not None else None, holding)


def in_use(region: str, jobs: Sequence[JobFacts]) -> dict[str, Any]:
    """What the running and paused capacity-scheduled jobs hold in ``region``."""
    holders = [facts for facts in jobs if facts.state in HOLDING and region in facts.needs]
    return {
        "gpus": sum(facts.needs[region].gpus for facts in holders),
        "cpu_slots": sum(facts.needs[region].cpu_slots for facts in holders),
        "jobs": sorted(facts.name for facts in holders),
    }


def capacity_json(capacity: Capacity | None) -> dict[str, Any] | None:
    """A region's capacity as the API shows it; None: unknown (treated as unlimited)."""
    return None if capacity is None else capacity.model_dump(mode="json")
