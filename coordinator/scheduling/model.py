"""What the scheduler decides about: regions with capacity, jobs with needs and phases.

Every input is a frozen value; what a region has in use is derived from the jobs that
hold it (:func:`coordinator.scheduling.capacity.free_capacity`), so the two cannot
disagree. Times are POSIX seconds passed in by the caller.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = ["Job", "Region", "RegionCapacity", "RegionNeed", "SchedulingState", "TrainingPhase"]


@dataclass(frozen=True, slots=True)
class RegionCapacity:
    """What one region offers: accelerators of one kind, and CPU worker slots."""

    gpus: int = 0
    gpu_kind: str | None = None
    gpu_memory_gib: float = 0.0
    cpu_slots: int = 0

    def __post_init__(self) -> None:
        if self.gpus < 0 or self.cpu_slots < 0 or self.gpu_memory_gib < 0:
            raise ValueError(f"capacity must not be negative: {self}")


@dataclass(frozen=True, slots=True)
class Region:
    """A region as the scheduler sees it; a region that is down offers nothing."""

    name: str
    capacity: RegionCapacity
    up: bool = True


@dataclass(frozen=True, slots=True)
class RegionNeed:
    """What a job needs in each region it runs in."""

    gpus: int = 0
    gpu_kind: str | None = None
    min_gpu_memory_gib: float = 0.0
    cpu_slots: int = 0

    def __post_init__(self) -> None:
        if self.gpus < 0 or self.cpu_slots < 0 or self.min_gpu_memory_gib < 0:
            raise ValueError(f"a need must not be negative: {self}")
        if self.gpus == 0 and self.cpu_slots == 0:
            raise ValueError("a need asks for at least one GPU or one CPU worker slot")


class SchedulingState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    PREEMPTING = "preempting"  # finishing its round; its regions are released at the boundary


@dataclass(frozen=True, slots=True)
class TrainingPhase:
    """Where a running job stands between global snapshots.

    ``rounds_since_snapshot`` counts the rounds completed since the last global snapshot;
    ``round_in_progress`` says whether a round is running (its boundary is ahead) or the
    job stands at a boundary; ``rounds_to_snapshot`` (at least 1) counts the rounds still
    to complete, the one in progress included, up to and including the round after which
    the next snapshot is taken.
    """

    rounds_since_snapshot: int
    rounds_to_snapshot: int
    round_in_progress: bool = True
    seconds_since_snapshot: float = 0.0

    def __post_init__(self) -> None:
        if self.rounds_since_snapshot < 0 or self.rounds_to_snapshot < 1:
            raise ValueError(f"invalid round counts: {self}")

    @property
    def rounds_at_next_boundary(self) -> int:
        """Rounds since the last snapshot at the job's next boundary (where it may stop)."""
        if not self.round_in_progress:
            return self.rounds_since_snapshot
        if self.rounds_to_snapshot == 1:
            return 0  # the round in progress ends in a snapshot
        return self.rounds_since_snapshot + 1

    @property
    def rounds_after_next_boundary_to_snapshot(self) -> int:
        """Rounds the job would run after its next boundary before the next snapshot."""
        if not self.round_in_progress:
            return self.rounds_to_snapshot
        return self.rounds_to_snapshot - 1


@dataclass(frozen=True, slots=True)
class Job:
    """One job: what it asks for, who owns it, where it stands.

    ``regions`` is the job's region list in order of preference; ``need`` applies to each
    region unless ``needs`` names a region's own. ``placement`` is the regions a running
    or preempting job holds; ``phase`` its training phase. ``claim`` is the regions whose
    capacity is being freed for a queued job by the jobs it preempted (``Wait.claim`` of
    the previous pass): that capacity is held back for it until it starts.
    """

    name: str
    team: str
    priority: str
    submitted_at: float
    regions: tuple[str, ...]
    need: RegionNeed
    min_regions: int = 1
    max_regions: int | None = None
    needs: Mapping[str, RegionNeed] = field(default_factory=dict)
    state: SchedulingState = SchedulingState.QUEUED
    placement: tuple[str, ...] = ()
    phase: TrainingPhase | None = None
    started_at: float | None = None
    claim: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.regions or len(set(self.regions)) != len(self.regions):
            raise ValueError(f"job {self.name}: regions must be distinct and not empty")
        if not 1 <= self.min_regions <= len(self.regions):
            raise ValueError(f"job {self.name}: min_regions must be 1..{len(self.regions)}")
        if self.max_regions is not None and self.max_regions < self.min_regions:
            raise ValueError(f"job {self.name}: max_regions is below min_regions")
        if self.state is not SchedulingState.QUEUED and not self.placement:
            raise ValueError(f"job {self.name}: a {self.state} job holds regions")
        unknown = set(self.placement) - set(self.regions)
        unknown |= set(self.claim) - set(self.regions)
        if unknown:
            raise ValueError(f"job {self.name}: placed on regions it does not list: {unknown}")

    def need_in(self, region: str) -> RegionNeed:
        return self.needs.get(region, self.need)

    def gpus_held(self) -> int:
        """GPUs this job holds now (0 while queued)."""
        return sum(self.need_in(region).gpus for region in self.placement)
