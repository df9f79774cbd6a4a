"""One scheduling pass: every waiting job admitted, left waiting or preempting, with why.

The waiting jobs are taken in :func:`coordinator.scheduling.queue.queue_order`; each is
admitted if it can be (:func:`coordinator.scheduling.admission.admit`) against what is
free after the jobs admitted before it in the pass and the capacity held back for
jobs ahead of it. A job blocked by capacity may preempt
(:func:`coordinator.scheduling.preemption.choose_victims`); the capacity it will take
once its victims stop is then held back for it (``Wait.claim``; passed back as
``Job.claim``, it is held back from the start of later passes until the job starts).
So is the capacity of the first ``max_reservations`` jobs, in queue order, that lack
capacity after waiting ``reserve_after_s`` or longer (their first ``min_regions``
usable regions), within the pass and from jobs of their priority class and below, so
that later, smaller jobs cannot keep them waiting for ever. Lower jobs may otherwise use
capacity a blocked job cannot (backfill).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from coordinator.scheduling.admission import Blocker, CapacityDecision, admit
from coordinator.scheduling.capacity import Free, Lack, free_capacity
from coordinator.scheduling.config import SchedulingConfig
from coordinator.scheduling.model import Job, Region, SchedulingState
from coordinator.scheduling.preemption import Victim, choose_victims
from coordinator.scheduling.queue import Ranked, queue_order
from coordinator.scheduling.quota import RunInterval, concurrent_gpus, team_gpu_hours

__all__ = ["Plan", "Wait", "plan"]


@dataclass(frozen=True, slots=True)
class Wait:
    """A job left waiting, what blocks it and why."""

    job: str
    blocker: Blocker
    reason: str
    effective_priority: int
    claim: tuple[str, ...] = ()  # regions being freed for it; pass back as Job.claim


@dataclass(frozen=True, slots=True)
class Plan:
    """What the pass decided: the order considered, admissions, waits and preemptions."""

    order: tuple[Ranked, ...]
    admitted: tuple[CapacityDecision, ...]
    waiting: tuple[Wait, ...]
    preempted: tuple[Victim, ...]


def plan(
    now: float,
    regions: Sequence[Region],
    jobs: Sequence[Job],
    config: SchedulingConfig,
    intervals: Iterable[RunInterval] = (),
) -> Plan:
    """Decide, at ``now``, which waiting jobs start, which wait and which jobs stop."""
    by_name = {region.name: region for region in regions}
    working = {job.name: job for job in jobs}
    if len(working) != len(jobs):
        raise ValueError("job names must be unique")
    held = concurrent_gpus(jobs)
    hours = team_gpu_hours(intervals, config, now)
    order = queue_order(jobs, now, held, config)
    held_back: dict[str, dict[str, Free]] = {}  # job -> region -> capacity held for it
    admitted: list[CapacityDecision] = []
    waiting: list[Wait] = []
    preempted: list[Victim] = []

    # What the jobs hold, kept up to date as the pass admits; a what-if adds back what
    # released jobs hold (free_capacity over every job per question would be quadratic).
    base = free_capacity(regions, jobs)
    reservations = 0

    def free_for(job: str, released: Iterable[str] = ()) -> dict[str, Free]:
        free = dict(base)
        for name in released:
            other = working[name]
            for where in other.placement:
                if where in free and by_name[where].up:
                    free[where] = free[where].plus(other.need_in(where))
        rank = config.priority_of(working[job].priority)
        for holder, holds in held_back.items():
            # A claim binds every other job; a waiting job's hold only the jobs of its
            # class and below (it must not keep a higher class off idle capacity).
            if holder != job and (holder in claims or rank <= held_rank[holder]):
                for name, amount in holds.items():
                    f = free[name]
                    free[name] = Free(f.gpus - amount.gpus, f.cpu_slots - amount.cpu_slots)
        return free

    claims: set[str] = set()
    held_rank: dict[str, int] = {}

    def hold_back(job: Job, names: Iterable[str], *, claim: bool) -> None:
        (claims.add if claim else claims.discard)(job.name)
        held_rank[job.name] = config.priority_of(job.priority)
        held_back[job.name] = {
            name: Free(job.need_in(name).gpus, job.need_in(name).cpu_slots)
            for name in names
            if name in by_name
        }

    for job in jobs:
        if job.state is SchedulingState.QUEUED and job.claim:
            hold_back(job, job.claim, claim=True)

    for ranked in order:
        job = ranked.job
        decision = admit(job, by_name, free_for(job.name), held, hours, config)
        held_back.pop(job.name, None)
        if decision.admitted:
            working[job.name] = dataclasses.replace(
                job, state=SchedulingState.RUNNING, placement=decision.regions, started_at=now
            )
            held[job.team] = held.get(job.team, 0) + working[job.name].gpus_held()
            for where in decision.regions:
                base[where] = base[where].minus(job.need_in(where))
            admitted.append(decision)
            continue
        reason = decision.reason
        claim: tuple[str, ...] = ()
        if decision.blocker is Blocker.CAPACITY:
            choice = choose_victims(
                job,
                list(working.values()),
                by_name,
                functools.partial(free_for, job.name),
                held,
                hours,
                config,
            )
            reason = f"{reason}; {choice.reason}"
            for victim in choice.victims:
                working[victim.job] = dataclasses.replace(
                    working[victim.job], state=SchedulingState.PREEMPTING
                )
                preempted.append(victim)
            if choice.admission is not None and choice.admission.admitted:
                claim = choice.admission.regions
                hold_back(job, claim, claim=True)
            elif (
                config.reserve_after_s is not None
                and ranked.waited_s >= config.reserve_after_s
                and reservations < config.max_reservations
            ):
                reservations += 1
                usable = [
                    name
                    for name in job.regions
                    if name not in decision.shortfalls
                    or decision.shortfalls[name].lack is Lack.BUSY
                ]
                hold_back(job, usable[: job.min_regions], claim=False)
                reason = f"{reason}; capacity held back for it after {ranked.waited_s:.0f} s"
        waiting.append(Wait(job.name, decision.blocker, reason, ranked.effective, claim))
    return Plan(tuple(order), tuple(admitted), tuple(waiting), tuple(preempted))
