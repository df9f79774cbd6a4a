"""Gang admission of one job: enough of its regions at once, within its team's quota.

A job is admitted when at least ``min_regions`` of its regions can run it now; it is
given the regions that can, in the order the job lists them, up to ``max_regions`` and
as many as its team's concurrent-GPU quota allows (never fewer than ``min_regions``).
Otherwise it is admitted nowhere and the decision says which region lacks what, or
which quota stops it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from coordinator.scheduling.capacity import Free, Lack, Shortfall, shortfall
from coordinator.scheduling.config import SchedulingConfig
from coordinator.scheduling.model import Job, Region
from coordinator.scheduling.quota import quota_refusal

__all__ = ["Blocker", "CapacityDecision", "admit"]


class Blocker(StrEnum):
    """What keeps a job waiting (``CapacityDecision.blocker``)."""

    NONE = "none"
    CAPACITY = "capacity"  # stopping other jobs could make room
    UNAVAILABLE = "unavailable"  # regions down or unable to run it; no preemption helps
    QUOTA = "quota"


@dataclass(frozen=True, slots=True)
class CapacityDecision:
    """The decision for one job: the regions it gets (empty: it waits) and why."""

    job: str
    regions: tuple[str, ...]
    reason: str
    blocker: Blocker = Blocker.NONE
    shortfalls: Mapping[str, Shortfall] = field(default_factory=dict)

    @property
    def admitted(self) -> bool:
        return bool(self.regions)


def admit(
    job: Job,
    regions: Mapping[str, Region],
    free: Mapping[str, Free],
    held: Mapping[str, int],
    hours: Mapping[str, float],
    config: SchedulingConfig,
) -> CapacityDecision:
    """Decide whether ``job`` starts now and where; ``free`` is what it may use."""
    fitting: list[str] = []
    short: dict[str, Shortfall] = {}
    for name in job.regions:
        lack = shortfall(job.need_in(name), regions.get(name), free)
        if lack is None:
            fitting.append(name)
        else:
            short[name] = lack
    if len(fitting) < job.min_regions:
        busy = sum(1 for s in short.values() if s.lack is Lack.BUSY)
        blocker = (
            Blocker.CAPACITY if len(fitting) + busy >= job.min_regions else Blocker.UNAVAILABLE
        )
        details = "; ".join(f"{name}: {s.reason}" for name, s in short.items())
        can = f" ({', '.join(fitting)})" if fitting else ""
        return CapacityDecision(
            job.name,
            (),
            f"needs {job.min_regions} region(s) at once, {len(fitting)} can run it now{can}; "
            f"{details}",
            blocker,
            short,
        )
    most = len(fitting) if job.max_regions is None else min(len(fitting), job.max_regions)
    refusal: str | None = None
    for count in range(most, job.min_regions - 1, -1):
        chosen = tuple(fitting[:count])
        gpus = sum(job.need_in(name).gpus for name in chosen)
        refusal = quota_refusal(job.team, gpus, held, hours, config)
        if refusal is None:
            fewer = f" (quota allows {count} of {most})" if count < most else ""
            return CapacityDecision(
                job.name,
                chosen,
                f"admitted on {count} region(s): {', '.join(chosen)}{fewer}",
                Blocker.NONE,
                short,
            )
    assert refusal is not None  # the loop ran at least once: most >= min_regions
    return CapacityDecision(job.name, (), refusal, Blocker.QUOTA, short)
