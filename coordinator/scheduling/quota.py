"""Team usage, accounted from run intervals, and whether a job fits its team's quota.

GPU-hours are counted over a sliding window ending now: each interval a job held GPUs
contributes its GPUs times its overlap with the window. An interval still open
(``end`` None) runs until now.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from coordinator.scheduling.config import SchedulingConfig
from coordinator.scheduling.model import Job, SchedulingState

__all__ = [
    "RunInterval",
    "concurrent_gpus",
    "gpu_hours",
    "quota_refusal",
    "team_gpu_hours",
    "uncounted_gpus_refusal",
]


@dataclass(frozen=True, slots=True)
class RunInterval:
    """A span during which one job of ``team`` held ``gpus`` GPUs."""

    team: str
    gpus: int
    start: float
    end: float | None = None

    def __post_init__(self) -> None:
        if self.gpus < 0 or (self.end is not None and self.end < self.start):
            raise ValueError(f"invalid run interval: {self}")


def gpu_hours(intervals: Iterable[RunInterval], since: float, now: float) -> dict[str, float]:
    """GPU-hours per team within ``[since, now]``."""
    if since > now:
        raise ValueError("the window starts after now")
    used: dict[str, float] = {}
    for interval in intervals:
        end = now if interval.end is None else min(interval.end, now)
        overlap = end - max(interval.start, since)
        if overlap > 0:
            used[interval.team] = used.get(interval.team, 0.0) + interval.gpus * overlap / 3600
    return used


def team_gpu_hours(
    intervals: Iterable[RunInterval], config: SchedulingConfig, now: float
) -> dict[str, float]:
    """GPU-hours per team over that team's own quota window (teams with a window only)."""
    spans = list(intervals)
    used: dict[str, float] = {}
    for team, quota in config.teams.items():
        if quota.window_s is not None:
            used[team] = gpu_hours(
                (s for s in spans if s.team == team), now - quota.window_s, now
            ).get(team, 0.0)
    return used


def concurrent_gpus(jobs: Iterable[Job]) -> dict[str, int]:
    """GPUs each team holds now (running and preempting jobs)."""
    held: dict[str, int] = {}
    for job in jobs:
        if job.state is not SchedulingState.QUEUED:
            held[job.team] = held.get(job.team, 0) + job.gpus_held()
    return held


def quota_refusal(
    team: str,
    gpus: int,
    held: Mapping[str, int],
    hours: Mapping[str, float],
    config: SchedulingConfig,
) -> str | None:
    """Why ``team`` may not take ``gpus`` more GPUs now, or None when it may."""
    quota = config.quota_of(team)
    if quota.concurrent_gpus is not None:
        now_held = held.get(team, 0)
        if now_held + gpus > quota.concurrent_gpus:
            return (
                f"team {team} holds {now_held} of its {quota.concurrent_gpus} concurrent GPUs, "
                f"job needs {gpus}"
            )
    if quota.gpu_hours is not None and quota.window_s is not None and gpus > 0:
        used = hours.get(team, 0.0)
        if used >= quota.gpu_hours:
            return (
                f"team {team} used {used:.1f} of its {quota.gpu_hours:g} GPU-hours "
                f"in the last {quota.window_s / 3600:g} h"
            )
    return None


def uncounted_gpus_refusal(
    team: str,
    config: SchedulingConfig,
    stated: Mapping[str, int],
    region_gpus: Mapping[str, int],
) -> str | None:
    """Why a job of ``team`` would use GPUs its quota cannot count, or None when it may run.

    A job trains on its regions' worker groups, and so on every GPU a region has, while a
    quota counts the GPUs a job states. ``stated``: the GPUs the job states per region (0
    for no needs, or CPU slots only); ``region_gpus``: the GPUs each of its regions last
    reported. A team with a GPU quota (concurrent or GPU-hours) states GPUs wherever
    there are some; a team without one is not counted, so it is not refused.
    """
    quota = config.quota_of(team)
    if quota.concurrent_gpus is None and quota.gpu_hours is None:
        return None
    uncounted = [
        f"{region} ({gpus} GPUs)"
        for region, gpus in region_gpus.items()
        if gpus > 0 and stated.get(region, 0) == 0
    ]
    if not uncounted:
        return None
    return (
        f"team {team} has a GPU quota and this job states no GPUs in {', '.join(uncounted)}, "
        "where it would train on the region's GPUs without the quota counting them; state "
        "them (needs.gpus, or region_needs.<region>.gpus) and the job waits for its quota"
    )
