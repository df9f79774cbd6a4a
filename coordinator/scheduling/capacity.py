"""What each region has free, and whether a job's need fits in what is free.

In use is what the running and preempting jobs hold (a preempting job holds its regions
until its round boundary); a region that is down has nothing free.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from coordinator.scheduling.model import Job, Region, RegionNeed, SchedulingState

__all__ = ["Free", "Lack", "Shortfall", "free_capacity", "shortfall"]


@dataclass(frozen=True, slots=True)
class Free:
    """A region's free GPUs and CPU worker slots."""

    gpus: int
    cpu_slots: int

    def minus(self, need: RegionNeed) -> Free:
        return Free(self.gpus - need.gpus, self.cpu_slots - need.cpu_slots)

    def plus(self, need: RegionNeed) -> Free:
        return Free(self.gpus + need.gpus, self.cpu_slots + need.cpu_slots)


def free_capacity(
    regions: Iterable[Region], jobs: Iterable[Job], *, released: Collection[str] = ()
) -> dict[str, Free]:
    """Free capacity per region; jobs named in ``released`` count as gone (a what-if)."""
    by_name = {region.name: region for region in regions}
    used_gpus = dict.fromkeys(by_name, 0)
    used_slots = dict.fromkeys(by_name, 0)
    for job in jobs:
        if job.state is SchedulingState.QUEUED or job.name in released:
            continue
        for name in job.placement:
            if name in by_name:
                need = job.need_in(name)
                used_gpus[name] += need.gpus
                used_slots[name] += need.cpu_slots
    return {
        name: Free(
            region.capacity.gpus - used_gpus[name], region.capacity.cpu_slots - used_slots[name]
        )
        if region.up
        else Free(0, 0)
        for name, region in by_name.items()
    }


class Lack(StrEnum):
    """Why a need does not fit: only ``BUSY`` can be cured by stopping other jobs."""

    UNFIT = "unfit"  # the region could never run it (kind, memory, size, unknown)
    DOWN = "down"
    BUSY = "busy"


@dataclass(frozen=True, slots=True)
class Shortfall:
    lack: Lack
    reason: str


def shortfall(
    need: RegionNeed, region: Region | None, free: Mapping[str, Free]
) -> Shortfall | None:
    """Why ``need`` does not fit in ``region`` now, or None when it fits."""
    if region is None:
        return Shortfall(Lack.UNFIT, "unknown region")
    capacity = region.capacity
    unfit = _unfit(need, region)
    if unfit is not None:
        return Shortfall(Lack.UNFIT, unfit)
    if not region.up:
        return Shortfall(Lack.DOWN, "region is down")
    left = free[region.name]
    if left.gpus < need.gpus:
        return Shortfall(
            Lack.BUSY, f"{max(left.gpus, 0)} of {capacity.gpus} GPUs free, job needs {need.gpus}"
        )
    if left.cpu_slots < need.cpu_slots:
        return Shortfall(
            Lack.BUSY,
            f"{max(left.cpu_slots, 0)} of {capacity.cpu_slots} CPU worker slots free, "
            f"job needs {need.cpu_slots}",
        )
    return None


def _unfit(need: RegionNeed, region: Region) -> str | None:
    capacity = region.capacity
    if need.gpus:
        if need.gpu_kind is not None and capacity.gpu_kind != need.gpu_kind:
            return f"has {capacity.gpu_kind or 'no'} GPUs, job needs {need.gpu_kind}"
        if capacity.gpu_memory_gib < need.min_gpu_memory_gib:
            return (
                f"GPUs have {capacity.gpu_memory_gib:g} GiB, job needs "
                f"{need.min_gpu_memory_gib:g} GiB"
            )
        if capacity.gpus < need.gpus:
            return f"has {capacity.gpus} GPUs in all, job needs {need.gpus}"
    if capacity.cpu_slots < need.cpu_slots:
        return f"has {capacity.cpu_slots} CPU worker slots in all, job needs {need.cpu_slots}"
    return None
