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
from collections.abc import Iterable, Mapping, Sequence
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
    if len({job.name for job in jobs}) != len(jobs):
        raise ValueError("job names must be unique")
    held = concurrent_gpus(jobs)
    order = queue_order(jobs, now, held, config)
    scheduling_pass = _Pass(
        now, regions, jobs, config, held, team_gpu_hours(intervals, config, now)
    )
    for job in jobs:
        if job.state is SchedulingState.QUEUED and job.claim:
            scheduling_pass.hold_back(job, job.claim, claim=True)
    for ranked in order:
        scheduling_pass.decide(ranked)
    return Plan(
        tuple(order),
        tuple(scheduling_pass.admitted),
        tuple(scheduling_pass.waiting),
        tuple(scheduling_pass.preempted),
    )


class _Pass:
    """One pass of :func:`plan` over the queue: what the jobs hold, kept up to date as it
    admits, and the capacity held back for waiting jobs."""

    def __init__(
        self,
        now: float,
        regions: Sequence[Region],
        jobs: Sequence[Job],
        config: SchedulingConfig,
        held: dict[str, int],
        hours: Mapping[str, float],
    ) -> None:
        self._now = now
        self._config = config
        self._held = held
        self._hours = hours
        self._by_name = {region.name: region for region in regions}
        self._working = {job.name: job for job in jobs}
        # A what-if adds back what released jobs hold (free_capacity over every job per
        # question would be quadratic).
        self._base = free_capacity(regions, jobs)
        self._held_back: dict[str, dict[str, Free]] = {}  # job -> region -> held for it
        self._claims: set[str] = set()
        self._held_rank: dict[str, int] = {}
        self._reservations = 0
        self.admitted: list[CapacityDecision] = []
        self.waiting: list[Wait] = []
        self.preempted: list[Victim] = []

    def free_for(self, job: str, released: Iterable[str] = ()) -> dict[str, Free]:
        """The capacity free for ``job`` were the ``released`` jobs gone."""
        free = dict(self._base)
        for name in released:
            other = self._working[name]
            for where in other.placement:
                if where in free and self._by_name[where].up:
                    free[where] = free[where].plus(other.need_in(where))
        rank = self._config.priority_of(self._working[job].priority)
        for holder, holds in self._held_back.items():
            # A claim binds every other job; a waiting job's hold only the jobs of its
            # class and below (it must not keep a higher class off idle capacity).
            if holder != job and (holder in self._claims or rank <= self._held_rank[holder]):
                for name, amount in holds.items():
                    f = free[name]
                    free[name] = Free(f.gpus - amount.gpus, f.cpu_slots - amount.cpu_slots)
        return free

    def hold_back(self, job: Job, names: Iterable[str], *, claim: bool) -> None:
        """Hold capacity in ``names`` for ``job``: a claim (victims are stopping for it) or
        a reservation (it waited long enough)."""
        (self._claims.add if claim else self._claims.discard)(job.name)
        self._held_rank[job.name] = self._config.priority_of(job.priority)
        self._held_back[job.name] = {
            name: Free(job.need_in(name).gpus, job.need_in(name).cpu_slots)
            for name in names
            if name in self._by_name
        }

    def decide(self, ranked: Ranked) -> None:
        """Admit the job ``ranked`` names, or say why it waits (preempting for it, or
        holding capacity back for it, where the config allows)."""
        job = ranked.job
        config = self._config
        decision = admit(
            job, self._by_name, self.free_for(job.name), self._held, self._hours, config
        )
        self._held_back.pop(job.name, None)
        if decision.admitted:
            running = dataclasses.replace(
                job, state=SchedulingState.RUNNING, placement=decision.regions, started_at=self._now
            )
            self._working[job.name] = running
            self._held[job.team] = self._held.get(job.team, 0) + running.gpus_held()
            for where in decision.regions:
                self._base[where] = self._base[where].minus(job.need_in(where))
            self.admitted.append(decision)
            return
        reason = decision.reason
        claim: tuple[str, ...] = ()
        if decision.blocker is Blocker.CAPACITY:
            choice = choose_victims(
                job,
                list(self._working.values()),
                self._by_name,
                functools.partial(self.free_for, job.name),
                self._held,
                self._hours,
                config,
            )
            reason = f"{reason}; {choice.reason}"
            for victim in choice.victims:
                self._working[victim.job] = dataclasses.replace(
                    self._working[victim.job], state=SchedulingState.PREEMPTING
                )
                self.preempted.append(victim)
            if choice.admission is not None and choice.admission.admitted:
                claim = choice.admission.regions
                self.hold_back(job, claim, claim=True)
            elif (
                config.reserve_after_s is not None
                and ranked.waited_s >= config.reserve_after_s
                and self._reservations < config.max_reservations
            ):
                self._reservations += 1
                usable = [
                    name
                    for name in job.regions
                    if name not in decision.shortfalls
                    or decision.shortfalls[name].lack is Lack.BUSY
                ]
                self.hold_back(job, usable[: job.min_regions], claim=False)
                reason = f"{reason}; capacity held back for it after {ranked.waited_s:.0f} s"
        self.waiting.append(Wait(job.name, decision.blocker, reason, ranked.effective, claim))
