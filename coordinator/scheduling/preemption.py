"""Which running jobs a waiting higher-priority job may stop, and why.

Rules:

* Only a job blocked by capacity preempts (not one over its quota, nor one whose regions
  are down or could never run it), and only jobs whose base priority is at least
  ``min_priority_gap`` below its own; ageing does not count.
* A victim is stopped at its next round boundary, never mid-round: its round in progress
  completes and is published, its regional state is checkpointed, then its regions are
  released. It resumes from that boundary, so it loses no rounds.
* A victim is not stopped within ``snapshot_window_rounds`` before its next global
  snapshot: it is eligible when its next boundary is a snapshot boundary, or when more
  than that many rounds would remain after that boundary before the snapshot. Otherwise
  it is stopped later, after its snapshot.
* Among eligible victims the scheduler prefers those with the fewest rounds since their
  last snapshot at their next boundary (the work that rests on the boundary checkpoint
  rather than a snapshot; 0 when that boundary follows a snapshot), then lower base
  priority, then the most recently started. It adds victims in that order until the job
  would be admitted, then drops any the admission does not need (latest added first).
* Jobs already preempting count as released: a job that fits once they stop waits for
  them and stops no one else.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from coordinator.scheduling.admission import CapacityDecision, admit
from coordinator.scheduling.capacity import Free
from coordinator.scheduling.config import SchedulingConfig
from coordinator.scheduling.model import Job, Region, SchedulingState

__all__ = ["Preemption", "Victim", "choose_victims", "lost_rounds", "victim_refusal"]

#: Free capacity given the names of the jobs counted as released.
FreeAfter = Callable[[Collection[str]], Mapping[str, Free]]


@dataclass(frozen=True, slots=True)
class Victim:
    """A job to stop at its next round boundary, for ``for_job``."""

    job: str
    for_job: str
    rounds_since_snapshot: int
    reason: str


@dataclass(frozen=True, slots=True)
class Preemption:
    """The victims chosen for one waiting job (empty: none), and why."""

    job: str
    victims: tuple[Victim, ...]
    reason: str
    admission: CapacityDecision | None = None  # what admission would give once they stop


def lost_rounds(job: Job, *, at_boundary: bool) -> int:
    """Rounds a job loses when stopped now: none at a boundary with its state saved.

    Stopped at once instead (mid-round, resuming from its last global snapshot), it
    loses the rounds completed since that snapshot and the round in progress.
    """
    if at_boundary or job.phase is None:
        return 0
    phase = job.phase
    return phase.rounds_since_snapshot + (1 if phase.round_in_progress else 0)


def victim_refusal(victim: Job, job: Job, config: SchedulingConfig) -> str | None:
    """Why ``victim`` may not be stopped for ``job`` now, or None when it may."""
    if victim.state is not SchedulingState.RUNNING:
        return f"{victim.name} is {victim.state}"
    gap = config.priority_of(job.priority) - config.priority_of(victim.priority)
    if gap < config.preemption.min_priority_gap:
        return (
            f"{victim.name} ({victim.priority}) is not {config.preemption.min_priority_gap} "
            f"below {job.priority}"
        )
    phase = victim.phase
    if phase is None:
        return f"{victim.name} reports no training phase"
    window = config.preemption.snapshot_window_rounds
    after = phase.rounds_after_next_boundary_to_snapshot
    if phase.rounds_at_next_boundary != 0 and after <= window:
        return (
            f"{victim.name}'s next snapshot is {after} round(s) after its next boundary "
            f"(window {window})"
        )
    return None


def choose_victims(
    job: Job,
    jobs: Sequence[Job],
    regions: Mapping[str, Region],
    free_after: FreeAfter,
    held: Mapping[str, int],
    hours: Mapping[str, float],
    config: SchedulingConfig,
) -> Preemption:
    """Choose the jobs to stop so that ``job`` can start, or say why none."""
    if not config.preemption.enabled:
        return Preemption(job.name, (), "preemption is off")
    stopping = frozenset(j.name for j in jobs if j.state is SchedulingState.PREEMPTING)
    if stopping:
        pending = admit(job, regions, free_after(stopping), held, hours, config)
        if pending.admitted:
            names = ", ".join(sorted(stopping))
            return Preemption(job.name, (), f"fits once preempting jobs stop: {names}", pending)
    wanted = set(job.regions)
    candidates: list[Job] = []
    refused: list[str] = []
    for other in jobs:
        if other.name == job.name or not wanted.intersection(other.placement):
            continue
        refusal = victim_refusal(other, job, config)
        if refusal is None:
            candidates.append(other)
        elif other.state is SchedulingState.RUNNING:
            refused.append(refusal)
    candidates.sort(key=lambda v: _cost(v, config))
    chosen: list[Job] = []
    outcome: CapacityDecision | None = None
    for victim in candidates:
        chosen.append(victim)
        outcome = _try(job, chosen, stopping, regions, free_after, held, hours, config)
        if outcome.admitted:
            break
    if outcome is None or not outcome.admitted:
        why = "; ".join(refused) if refused else "no other job holds its regions"
        return Preemption(
            job.name,
            (),
            f"stopping all {len(candidates)} eligible job(s) would not make room; "
            f"not eligible: {why}",
        )
    for victim in reversed(chosen[:-1]):
        rest = [v for v in chosen if v is not victim]
        trial = _try(job, rest, stopping, regions, free_after, held, hours, config)
        if trial.admitted:
            chosen, outcome = rest, trial
    victims = tuple(
        Victim(
            v.name,
            job.name,
            _rounds(v),
            f"stopped at its next round boundary for {job.name} ({job.priority} over "
            f"{v.priority}); {_rounds(v)} round(s) since its last snapshot there, 0 lost",
        )
        for v in chosen
    )
    names = ", ".join(v.job for v in victims)
    return Preemption(job.name, victims, f"preempting {names} at their round boundary", outcome)


def _rounds(job: Job) -> int:
    return job.phase.rounds_at_next_boundary if job.phase is not None else 0


def _cost(victim: Job, config: SchedulingConfig) -> tuple[int, int, float, str]:
    started = victim.started_at if victim.started_at is not None else victim.submitted_at
    return (_rounds(victim), config.priority_of(victim.priority), -started, victim.name)


def _try(
    job: Job,
    victims: Sequence[Job],
    stopping: Collection[str],
    regions: Mapping[str, Region],
    free_after: FreeAfter,
    held: Mapping[str, int],
    hours: Mapping[str, float],
    config: SchedulingConfig,
) -> CapacityDecision:
    released = {*stopping, *(v.name for v in victims)}
    freed: dict[str, int] = dict(held)
    for victim in victims:
        freed[victim.team] = freed.get(victim.team, 0) - victim.gpus_held()
    return admit(job, regions, free_after(released), freed, hours, config)
