"""The order in which waiting jobs are considered.

Sort keys, in order: a claim first (a job that has stopped others takes what they free
before anyone else, or the stop would be wasted), effective priority (highest first),
the team's fair share (the GPUs its jobs hold divided by its weight; lowest first),
submission time (earliest first), then the name. The effective priority is the class's
number plus ageing: ``boost`` for every full ``every_s`` waited (up to ``max_boost`` when set), so a
low-priority job rises past higher classes if it waits long enough. Ageing orders the
queue only; preemption compares base priorities (an aged job does not stop others).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from coordinator.scheduling.config import SchedulingConfig
from coordinator.scheduling.model import Job, SchedulingState

__all__ = ["Ranked", "effective_priority", "fair_share", "queue_order"]


@dataclass(frozen=True, slots=True)
class Ranked:
    """A waiting job with the keys it was ordered by."""

    job: Job
    base: int
    effective: int
    share: float
    waited_s: float


def effective_priority(job: Job, now: float, config: SchedulingConfig) -> int:
    """The job's class number plus what waiting has added by ``now``."""
    base = config.priority_of(job.priority)
    ageing = config.ageing
    steps = int(max(0.0, now - job.submitted_at) // ageing.every_s)
    boost = steps * ageing.boost
    if ageing.max_boost is not None:
        boost = min(boost, ageing.max_boost)
    return base + boost


def fair_share(team: str, held: Mapping[str, int], config: SchedulingConfig) -> float:
    """The GPUs ``team`` holds per unit of its weight."""
    return held.get(team, 0) / config.quota_of(team).weight


def queue_order(
    jobs: Iterable[Job], now: float, held: Mapping[str, int], config: SchedulingConfig
) -> list[Ranked]:
    """The queued jobs of ``jobs``, in the order admission considers them."""
    ranked = [
        Ranked(
            job,
            config.priority_of(job.priority),
            effective_priority(job, now, config),
            fair_share(job.team, held, config) if config.fair_share else 0.0,
            max(0.0, now - job.submitted_at),
        )
        for job in jobs
        if job.state is SchedulingState.QUEUED
    ]
    ranked.sort(
        key=lambda r: (not r.job.claim, -r.effective, r.share, r.job.submitted_at, r.job.name)
    )
    return ranked
