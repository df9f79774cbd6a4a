"""Preemption that respects the training phase, and the Young/Daly snapshot interval."""

from __future__ import annotations

import dataclasses
import math

import pytest

from coordinator.scheduling import (
    Job,
    Preemption,
    PreemptionConfig,
    Region,
    RegionCapacity,
    RegionNeed,
    SchedulingConfig,
    SchedulingState,
    TrainingPhase,
    choose_victims,
    combined_mtbf,
    free_capacity,
    lost_rounds,
    observed_mtbf,
    plan,
    snapshot_interval,
)
from coordinator.scheduling.preemption import victim_refusal

CONFIG = SchedulingConfig()
REGIONS = [Region("a", RegionCapacity(gpus=8)), Region("b", RegionCapacity(gpus=8))]


def running(
    name: str,
    gpus: int = 8,
    *,
    priority: str = "research",
    since: int = 0,
    to: int = 5,
    in_progress: bool = True,
    placement: tuple[str, ...] = ("a",),
    started: float = 0.0,
    team: str = "vision",
) -> Job:
    return Job(
        name=name,
        team=team,
        priority=priority,
        submitted_at=0.0,
        regions=("a", "b"),
        need=RegionNeed(gpus=gpus),
        min_regions=1,
        state=SchedulingState.RUNNING,
        placement=placement,
        phase=TrainingPhase(since, to, in_progress),
        started_at=started,
    )


def waiting(
    name: str = "urgent",
    gpus: int = 8,
    priority: str = "production",
    regions: tuple[str, ...] = ("a",),
) -> Job:
    """A job waiting for all of its regions at once."""
    return Job(name, "vision", priority, 100.0, regions, RegionNeed(gpus=gpus), len(regions))


def choose(candidate: Job, jobs: list[Job], config: SchedulingConfig = CONFIG) -> Preemption:
    return choose_victims(
        candidate,
        jobs,
        {r.name: r for r in REGIONS},
        lambda released: free_capacity(REGIONS, jobs, released=released),
        {},
        {},
        config,
    )


# -- the phase ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "at_boundary", "after"),
    [
        # In round 3 of 5 since the snapshot: stops after it with 3 rounds since.
        (TrainingPhase(2, 3, True), 3, 2),
        # The round in progress ends in a snapshot: stops right after it.
        (TrainingPhase(4, 1, True), 0, 0),
        # Standing at the boundary right after a snapshot.
        (TrainingPhase(0, 5, False), 0, 5),
        # Standing at a boundary two rounds after a snapshot.
        (TrainingPhase(2, 3, False), 2, 3),
    ],
)
def test_phase_at_the_next_boundary(phase: TrainingPhase, at_boundary: int, after: int) -> None:
    assert phase.rounds_at_next_boundary == at_boundary
    assert phase.rounds_after_next_boundary_to_snapshot == after


def test_lost_rounds_are_zero_at_a_boundary_and_the_rounds_since_the_snapshot_at_once() -> None:
    victim = running("v", since=3, to=2)
    assert lost_rounds(victim, at_boundary=True) == 0
    assert lost_rounds(victim, at_boundary=False) == 4  # 3 done since the snapshot + 1 partial
    at_boundary_after_snapshot = running("w", since=0, to=5, in_progress=False)
    assert lost_rounds(at_boundary_after_snapshot, at_boundary=False) == 0


# -- eligibility --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("victim", "candidate", "config", "refusal"),
    [
        (running("v"), waiting(), CONFIG, None),
        (
            running("v", priority="production"),
            waiting(),
            CONFIG,
            "v (production) is not 1 below production",
        ),
        (
            running("v", priority="research"),
            waiting(),
            SchedulingConfig(preemption=PreemptionConfig(min_priority_gap=60)),
            "v (research) is not 60 below production",
        ),
        # Next boundary is 1 round before the snapshot: inside the 1-round window.
        (
            running("v", since=2, to=2),
            waiting(),
            CONFIG,
            "v's next snapshot is 1 round(s) after its next boundary (window 1)",
        ),
        # Next boundary is the snapshot boundary itself: stopping there loses nothing.
        (running("v", since=4, to=1), waiting(), CONFIG, None),
        # Two rounds before the snapshot: outside a 1-round window, inside a 2-round one.
        (running("v", since=1, to=3), waiting(), CONFIG, None),
        (
            running("v", since=1, to=3),
            waiting(),
            SchedulingConfig(preemption=PreemptionConfig(snapshot_window_rounds=2)),
            "v's next snapshot is 2 round(s) after its next boundary (window 2)",
        ),
        (
            running("v", since=2, to=2),
            waiting(),
            SchedulingConfig(preemption=PreemptionConfig(snapshot_window_rounds=0)),
            None,
        ),
    ],
)
def test_victim_eligibility(
    victim: Job, candidate: Job, config: SchedulingConfig, refusal: str | None
) -> None:
    assert victim_refusal(victim, candidate, config) == refusal


def test_a_preempting_job_is_not_a_victim_again() -> None:
    stopping = dataclasses.replace(running("v"), state=SchedulingState.PREEMPTING)
    assert victim_refusal(stopping, waiting(), CONFIG) == "v is preempting"


# -- choosing victims ---------------------------------------------------------------


def test_the_victim_with_least_work_since_its_snapshot_is_chosen() -> None:
    jobs = [
        running("busy", 4, since=3, to=2, placement=("a",)),
        running("fresh", 4, since=4, to=1, placement=("a",)),  # its boundary is a snapshot
    ]
    chosen = choose(waiting(gpus=4), jobs)
    assert [v.job for v in chosen.victims] == ["fresh"]
    assert chosen.victims[0].rounds_since_snapshot == 0
    assert chosen.victims[0].reason == (
        "stopped at its next round boundary for urgent (production over research); "
        "0 round(s) since its last snapshot there, 0 lost"
    )
    assert chosen.admission is not None
    assert chosen.admission.regions == ("a",)


def test_lower_priority_and_then_later_start_break_ties() -> None:
    jobs = [
        running("research-old", 4, started=0.0, placement=("a",)),
        running("best-effort", 4, priority="best-effort", started=0.0, placement=("a",)),
    ]
    assert [v.job for v in choose(waiting(gpus=4), jobs).victims] == ["best-effort"]
    jobs = [running("old", 4, started=0.0), running("new", 4, started=50.0)]
    assert [v.job for v in choose(waiting(gpus=4), jobs).victims] == ["new"]


def test_victims_the_admission_does_not_need_are_dropped() -> None:
    # Cheapest first is "small" (2 GPUs), which alone is not enough; "big" is; once "big"
    # is chosen "small" is not needed and is spared.
    jobs = [
        running("small", 2, since=0, to=5, in_progress=False, placement=("a",)),
        running("big", 6, since=1, to=3, placement=("a",)),
    ]
    chosen = choose(waiting(gpus=6), jobs)
    assert [v.job for v in chosen.victims] == ["big"]


def test_no_victims_when_only_jobs_in_the_window_hold_the_regions() -> None:
    jobs = [running("v", since=2, to=2)]
    chosen = choose(waiting(), jobs)
    assert chosen.victims == ()
    assert chosen.reason == (
        "stopping all 0 eligible job(s) would not make room; not eligible: "
        "v's next snapshot is 1 round(s) after its next boundary (window 1)"
    )


def test_gang_preemption_needs_room_in_enough_regions() -> None:
    jobs = [
        running("on-a", 8, placement=("a",)),
        running("on-b", 8, priority="production", placement=("b",)),
    ]
    chosen = choose(waiting(regions=("a", "b")), jobs)
    assert chosen.victims == ()  # freeing a alone leaves the gang one region short
    assert "on-b (production) is not 1 below production" in chosen.reason


def test_preemption_off() -> None:
    config = SchedulingConfig(preemption=PreemptionConfig(enabled=False))
    assert choose(waiting(), [running("v")], config).reason == "preemption is off"


def test_jobs_already_stopping_are_counted_before_stopping_more() -> None:
    stopping = dataclasses.replace(
        running("s", 8, placement=("a",)), state=SchedulingState.PREEMPTING
    )
    other = running("o", 8, placement=("b",))
    # a is being freed by s: a job that needs only a waits for it and stops no one.
    chosen = choose(waiting(regions=("a",)), [stopping, other])
    assert chosen.victims == ()
    assert chosen.reason == "fits once preempting jobs stop: s"
    # A gang over a and b needs b too: o stops, s is counted as gone already.
    chosen = choose(waiting(regions=("a", "b")), [stopping, other])
    assert [v.job for v in chosen.victims] == ["o"]


# -- in a pass ------------------------------------------------------------------------


def test_pass_preempts_and_claims_the_capacity_then_starts_the_job_first() -> None:
    victim = running("v", 8, placement=("a",))
    urgent = waiting()
    decided = plan(200.0, REGIONS, [victim, urgent], CONFIG)
    assert [v.job for v in decided.preempted] == ["v"]
    (wait,) = decided.waiting
    assert wait.claim == ("a",)
    assert "preempting v at their round boundary" in wait.reason

    # The victim stopped at its boundary and waits again; an aged best-effort job that
    # now ranks above the production job must not take the capacity freed for it.
    stopped = dataclasses.replace(victim, state=SchedulingState.QUEUED, placement=(), phase=None)
    aged = Job("aged", "nlp", "best-effort", -100 * 3600.0, ("a",), RegionNeed(gpus=8))
    claimant = dataclasses.replace(urgent, claim=("a",))
    later = plan(900.0, REGIONS, [stopped, aged, claimant], CONFIG)
    assert [(a.job, a.regions) for a in later.admitted] == [("urgent", ("a",)), ("v", ("b",))]
    assert [w.job for w in later.waiting] == ["aged"]
    assert later.preempted == ()
    # Without the claim the aged job would have gone first and taken a.
    unclaimed = plan(900.0, REGIONS, [stopped, aged, urgent], CONFIG)
    assert unclaimed.admitted[0].job == "aged"


def test_an_aged_job_does_not_preempt_by_its_effective_priority() -> None:
    victim = running("v", 8, priority="research", placement=("a",))
    aged = Job("aged", "vision", "best-effort", -100 * 3600.0, ("a",), RegionNeed(gpus=8))
    decided = plan(0.0, REGIONS, [victim, aged], CONFIG)
    assert decided.preempted == ()
    assert decided.waiting[0].effective_priority > CONFIG.priority_of("production")


# -- the snapshot interval ----------------------------------------------------------


@pytest.mark.parametrize(
    ("cost", "mtbf", "round_s", "bounds", "rounds", "reason"),
    [
        (
            60.0,
            86400.0,
            600.0,
            (1, 100),
            5,
            "Young/Daly: sqrt(2 x 60 s x 86400 s) = 3220 s = 5.4 rounds of 600 s",
        ),
        (60.0, 86400.0, 600.0, (8, 100), 8, "= 5.4 rounds of 600 s, raised to the job's minimum 8"),
        (600.0, 10 * 86400.0, 60.0, (1, 20), 20, "lowered to the job's maximum 20"),
        (
            None,
            86400.0,
            600.0,
            (1, 50),
            50,
            "no snapshot cost measured yet: the job's longest interval",
        ),
        (60.0, None, 600.0, (1, 50), 50, "no failures measured yet: the job's longest interval"),
    ],
)
def test_snapshot_interval(
    cost: float | None,
    mtbf: float | None,
    round_s: float,
    bounds: tuple[int, int],
    rounds: int,
    reason: str,
) -> None:
    chosen = snapshot_interval(cost, mtbf, round_s, min_rounds=bounds[0], max_rounds=bounds[1])
    assert chosen.rounds == rounds
    assert reason in chosen.reason
    if cost is not None and mtbf is not None:
        assert chosen.tau_s == pytest.approx(math.sqrt(2 * cost * mtbf))


def test_mtbf_of_a_job_combines_its_regions() -> None:
    assert combined_mtbf([3600.0, 3600.0]) == pytest.approx(1800.0)
    assert combined_mtbf([3600.0, None]) == pytest.approx(3600.0)
    assert combined_mtbf([None]) is None
    assert observed_mtbf(4, 8 * 3600.0) == pytest.approx(7200.0)
    assert observed_mtbf(0, 8 * 3600.0) is None
    # A region that failed before any exposure was measured (an agent crash within the
    # job's first round) gives no rate yet, rather than an MTBF of zero.
    assert observed_mtbf(1, 0.0) is None
    assert combined_mtbf([observed_mtbf(1, 0.0), 3600.0]) == pytest.approx(3600.0)


def test_snapshot_interval_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        snapshot_interval(60.0, 3600.0, 0.0)
    with pytest.raises(ValueError):
        snapshot_interval(60.0, 3600.0, 60.0, min_rounds=5, max_rounds=2)
    with pytest.raises(ValueError):
        snapshot_interval(-1.0, 3600.0, 60.0)
