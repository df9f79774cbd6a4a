"""Elastic jobs, pure: whether a region may join or leave a job, and its data shard slot.

A job has a fixed number of data shard slots for its whole life (``max_regions``, fixed
at submission). The regions it is submitted with take the slots of their sorted order
(so a job that never changes reads the data it always read); a region that joins takes
the lowest free slot; a region that leaves frees its slot, and a later joiner may take
it (the lowest free slot first). A region's shard is thus fixed by the job's assignment,
never by who takes part in a round.

Every region that ever took part stays among the job's *contributors*: the global
parameters derive from its data for good, so residency decisions about them keep
counting its datasets after it left.

:func:`decide_change` answers the structural questions (is the job still running, is
the region known, is there a free slot, would a removal drop below ``min_regions``);
residency (:func:`joined_provenance`, decided by the policy engine) and capacity
(:func:`join_shortfall`) are asked by the caller for a join that passes it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from coordinator.scheduling.capacity import free_capacity, shortfall
from coordinator.scheduling.model import Job, Region, RegionNeed

__all__ = [
    "ANSWER",
    "ChangeDecision",
    "Membership",
    "Refusal",
    "RegionChange",
    "decide_change",
    "join_shortfall",
    "joined_provenance",
]


@dataclass(frozen=True, slots=True)
class Membership:
    """A job's regions with their shard slots, and every region that ever took part.

    ``assignment``: member region -> its slot (distinct, below ``slots``);
    ``datasets``: every contributor (members and those that left) -> its datasets.
    """

    slots: int
    assignment: Mapping[str, int]
    datasets: Mapping[str, tuple[str, ...]]

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"a job has at least one shard slot, not {self.slots}")
        taken = list(self.assignment.values())
        if len(set(taken)) != len(taken) or any(not 0 <= s < self.slots for s in taken):
            raise ValueError(f"slots {dict(self.assignment)} are not distinct in 0..{self.slots}")
        strangers = set(self.assignment) - set(self.datasets)
        if strangers:
            raise ValueError(f"members {sorted(strangers)} have no datasets")
        object.__setattr__(
            self, "assignment", MappingProxyType(dict(sorted(self.assignment.items())))
        )
        frozen = {region: tuple(sets) for region, sets in sorted(self.datasets.items())}
        object.__setattr__(self, "datasets", MappingProxyType(frozen))

    @classmethod
    def initial(cls, regions: Mapping[str, Sequence[str]], slots: int) -> Membership:
        """The regions a job is submitted with, each on the slot of its sorted place."""
        ordered = sorted(regions)
        return cls(
            slots,
            {region: index for index, region in enumerate(ordered)},
            {region: tuple(regions[region]) for region in ordered},
        )

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(self.assignment)

    def member_datasets(self) -> dict[str, tuple[str, ...]]:
        """Each member region with the datasets it trains on, in name order."""
        return {region: self.datasets[region] for region in self.assignment}

    @property
    def departed(self) -> tuple[str, ...]:
        """Regions that took part and left (their data still shapes the model)."""
        return tuple(region for region in self.datasets if region not in self.assignment)

    def lowest_free_slot(self) -> int | None:
        taken = set(self.assignment.values())
        return next((slot for slot in range(self.slots) if slot not in taken), None)

    def joined(self, region: str, datasets: Sequence[str]) -> Membership:
        """``region`` added on the lowest free slot (ValueError if none is free)."""
        slot = self.lowest_free_slot()
        if slot is None:
            raise ValueError(f"all {self.slots} shard slots are taken")
        both = {**self.datasets, region: _union(self.datasets.get(region, ()), datasets)}
        return Membership(self.slots, {**self.assignment, region: slot}, both)

    def left(self, region: str) -> Membership:
        """``region`` gone from the members; its slot free, its data still counted."""
        rest = {name: slot for name, slot in self.assignment.items() if name != region}
        return Membership(self.slots, rest, self.datasets)


def _union(old: Iterable[str], new: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys([*old, *new]))


@dataclass(frozen=True, slots=True)
class RegionChange:
    """An operator's request: ``add`` a region (training on ``datasets``) or ``remove`` one."""

    action: str
    region: str
    datasets: tuple[str, ...] = ()


class Refusal(StrEnum):
    """Why a change is refused; the API answers each with its own status."""

    JOB_ENDED = "invalid_state"  # the job completed, failed or was cancelled
    UNKNOWN_REGION = "unknown_region"  # no loaded policy declares the region
    ALREADY_MEMBER = "already_member"
    NOT_MEMBER = "not_member"
    MAX_REGIONS = "max_regions"  # every shard slot is taken
    MIN_REGIONS = "min_regions"  # the job would drop below its quorum
    EVALUATES = "evaluating_region"  # the job's evaluation names the region
    BAD_REQUEST = "bad_request"


#: The HTTP status and error code of each refusal (the refusal itself goes beside them).
ANSWER: Mapping[Refusal, tuple[int, str]] = MappingProxyType(
    {
        Refusal.JOB_ENDED: (409, "invalid_state"),
        Refusal.UNKNOWN_REGION: (404, "not_found"),
        Refusal.ALREADY_MEMBER: (409, "invalid_state"),
        Refusal.NOT_MEMBER: (409, "invalid_state"),
        Refusal.MAX_REGIONS: (409, "invalid_state"),
        Refusal.MIN_REGIONS: (409, "invalid_state"),
        Refusal.EVALUATES: (409, "invalid_state"),
        Refusal.BAD_REQUEST: (400, "bad_request"),
    }
)


@dataclass(frozen=True, slots=True)
class ChangeDecision:
    """The decision on one change: the membership after it (None: refused) and why."""

    reason: str
    membership: Membership | None = None
    refusal: Refusal | None = None
    slot: int | None = None  # a join's shard slot
    details: Mapping[str, object] = field(default_factory=dict)

    @property
    def allowed(self) -> bool:
        return self.membership is not None

    @property
    def status(self) -> int:
        return 200 if self.refusal is None else ANSWER[self.refusal][0]

    @property
    def code(self) -> str:
        """The API's error code of a refusal (``refusal`` says which one)."""
        return "" if self.refusal is None else ANSWER[self.refusal][1]


def decide_change(
    change: RegionChange,
    membership: Membership,
    *,
    job: str,
    ended: str = "",
    min_regions: int,
    known_regions: Collection[str],
    evaluation_region: str | None = None,
) -> ChangeDecision:
    """Whether ``change`` may be made to ``job`` as it stands, and the membership after it.

    ``ended`` is the job's final state (empty while it may still run); ``min_regions``
    the job's quorum; ``known_regions`` the regions the coordinator has policies for;
    ``evaluation_region`` the region the job's evaluation names, if it names one.
    """
    region = change.region

    def refuse(refusal: Refusal, reason: str) -> ChangeDecision:
        return ChangeDecision(reason, refusal=refusal)

    if ended:
        return refuse(Refusal.JOB_ENDED, f"job {job} is {ended}: its regions no longer change")
    members = membership.members
    if change.action == "add":
        if region in membership.assignment:
            return refuse(Refusal.ALREADY_MEMBER, f"region {region} already takes part in {job}")
        if region not in known_regions:
            return refuse(
                Refusal.UNKNOWN_REGION,
                f"no loaded policy declares region {region}; known: {sorted(known_regions)}",
            )
        if not change.datasets:
            return refuse(Refusal.BAD_REQUEST, f"name the datasets {region} trains on for {job}")
        slot = membership.lowest_free_slot()
        if slot is None:
            return refuse(
                Refusal.MAX_REGIONS,
                f"job {job} runs on {len(members)} region(s), its max_regions "
                f"({membership.slots}): remove one first",
            )
        after = membership.joined(region, change.datasets)
        return ChangeDecision(
            f"region {region} joins {job} on data shard {slot} of {membership.slots}",
            after,
            slot=slot,
        )
    if change.action == "remove":
        if region not in membership.assignment:
            return refuse(
                Refusal.NOT_MEMBER, f"region {region} does not take part in {job} ({list(members)})"
            )
        if len(members) - 1 < min_regions:
            return refuse(
                Refusal.MIN_REGIONS,
                f"removing {region} leaves {job} {len(members) - 1} region(s), below its "
                f"min_regions ({min_regions})",
            )
        if region == evaluation_region:
            return refuse(
                Refusal.EVALUATES,
                f"job {job} evaluates on region {region} (evaluation.where): it cannot leave",
            )
        slot = membership.assignment[region]
        return ChangeDecision(
            f"region {region} leaves {job}; data shard {slot} is free for a later joiner",
            membership.left(region),
            slot=slot,
        )
    return refuse(Refusal.BAD_REQUEST, f"unknown change {change.action!r}; use add or remove")


def joined_provenance(
    membership: Membership, region: str, datasets: Sequence[str]
) -> dict[str, tuple[str, ...]]:
    """Every region the job's parameters would derive from once ``region`` joined: the
    placement a join's residency check decides (as at admission), departed ones included."""
    regions = dict(membership.datasets)
    regions[region] = _union(regions.get(region, ()), datasets)
    return regions


def join_shortfall(need: RegionNeed, region: Region | None, jobs: Sequence[Job]) -> str | None:
    """Why ``need`` does not fit in ``region`` beside the capacity ``jobs`` hold, or None."""
    if region is None:
        return "the region has reported no status"
    free = free_capacity([region], jobs)
    lack = shortfall(need, region, free)
    return None if lack is None else f"{region.name}: {lack.reason}"
