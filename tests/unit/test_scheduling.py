"""The scheduler's pure decisions: capacity, quotas, queue order, gang admission, a pass."""

from __future__ import annotations

import pytest

from coordinator.config import ConfigError
from coordinator.scheduling import (
    AgeingConfig,
    Blocker,
    Job,
    Lack,
    Region,
    RegionCapacity,
    RegionNeed,
    RunInterval,
    SchedulingConfig,
    SchedulingState,
    TeamQuota,
    TrainingPhase,
    admit,
    concurrent_gpus,
    effective_priority,
    free_capacity,
    gpu_hours,
    parse_scheduling_config,
    plan,
    queue_order,
    quota_refusal,
    shortfall,
    uncounted_gpus_refusal,
)

H = 3600.0
CONFIG = SchedulingConfig()


def region(
    name: str, gpus: int = 8, *, kind: str = "h100", memory: float = 80, up: bool = True
) -> Region:
    return Region(name, RegionCapacity(gpus=gpus, gpu_kind=kind, gpu_memory_gib=memory), up)


def job(
    name: str,
    regions: tuple[str, ...] = ("a", "b"),
    gpus: int = 4,
    *,
    priority: str = "research",
    team: str = "vision",
    submitted: float = 0.0,
    min_regions: int | None = None,
    state: SchedulingState = SchedulingState.QUEUED,
    placement: tuple[str, ...] = (),
    phase: TrainingPhase | None = None,
    **extra: object,
) -> Job:
    if state is not SchedulingState.QUEUED and phase is None:
        phase = TrainingPhase(rounds_since_snapshot=0, rounds_to_snapshot=5)
    return Job(
        name=name,
        team=team,
        priority=priority,
        submitted_at=submitted,
        regions=regions,
        need=RegionNeed(gpus=gpus),
        min_regions=len(regions) if min_regions is None else min_regions,
        state=state,
        placement=placement,
        phase=phase,
        **extra,  # type: ignore[arg-type]
    )


def regions_map(*regions: Region) -> dict[str, Region]:
    return {r.name: r for r in regions}


# -- capacity ---------------------------------------------------------------------


def test_free_capacity_counts_running_and_preempting_jobs_and_down_regions() -> None:
    regions = [region("a", 8), region("b", 16), region("c", 8, up=False)]
    jobs = [
        job("r", placement=("a", "b"), state=SchedulingState.RUNNING, gpus=2),
        job("p", placement=("b",), state=SchedulingState.PREEMPTING, gpus=4),
        job("q", gpus=8),
    ]
    free = free_capacity(regions, jobs)
    assert (free["a"].gpus, free["b"].gpus, free["c"].gpus) == (6, 10, 0)
    assert free_capacity(regions, jobs, released={"p"})["b"].gpus == 14


@pytest.mark.parametrize(
    ("need", "where", "lack", "reason"),
    [
        (RegionNeed(gpus=4), region("a"), None, None),
        (
            RegionNeed(gpus=4, gpu_kind="a100"),
            region("a"),
            Lack.UNFIT,
            "has h100 GPUs, job needs a100",
        ),
        (
            RegionNeed(gpus=1, min_gpu_memory_gib=141),
            region("a"),
            Lack.UNFIT,
            "GPUs have 80 GiB, job needs 141 GiB",
        ),
        (RegionNeed(gpus=16), region("a"), Lack.UNFIT, "has 8 GPUs in all, job needs 16"),
        (
            RegionNeed(cpu_slots=2),
            region("a"),
            Lack.UNFIT,
            "has 0 CPU worker slots in all, job needs 2",
        ),
        (RegionNeed(gpus=4), region("a", up=False), Lack.DOWN, "region is down"),
        (RegionNeed(gpus=8), region("a"), Lack.BUSY, "6 of 8 GPUs free, job needs 8"),
        (RegionNeed(gpus=1), None, Lack.UNFIT, "unknown region"),
    ],
)
def test_shortfall_names_what_is_missing(
    need: RegionNeed, where: Region | None, lack: Lack | None, reason: str | None
) -> None:
    running = job("r", ("a",), 2, state=SchedulingState.RUNNING, placement=("a",))
    free = free_capacity([region("a")], [running])
    found = shortfall(need, where, free)
    assert (found.lack if found else None, found.reason if found else None) == (lack, reason)


def test_cpu_worker_slots_are_capacity_too() -> None:
    cpu = Region("cpu", RegionCapacity(cpu_slots=4))
    running = Job(
        "r",
        "t",
        "research",
        0,
        ("cpu",),
        RegionNeed(cpu_slots=3),
        state=SchedulingState.RUNNING,
        placement=("cpu",),
        phase=TrainingPhase(0, 1),
    )
    found = shortfall(RegionNeed(cpu_slots=2), cpu, free_capacity([cpu], [running]))
    assert found is not None
    assert found.reason == "1 of 4 CPU worker slots free, job needs 2"


# -- quotas -----------------------------------------------------------------------


def test_gpu_hours_count_only_the_window_and_open_intervals_until_now() -> None:
    intervals = [
        RunInterval("vision", 8, start=0, end=2 * H),  # 1 h inside the window [1 h, 5 h]
        RunInterval("vision", 4, start=4 * H),  # open: 1 h until now
        RunInterval("nlp", 2, start=0, end=0.5 * H),  # before the window
        RunInterval("nlp", 1, start=3 * H, end=10 * H),  # ends after now: cut at now
    ]
    used = gpu_hours(intervals, since=1 * H, now=5 * H)
    assert used == pytest.approx({"vision": 12.0, "nlp": 2.0})


@pytest.mark.parametrize(
    ("quota", "held", "hours", "gpus", "expected"),
    [
        (TeamQuota(), 100, 1e9, 8, None),
        (TeamQuota(concurrent_gpus=16), 8, 0, 8, None),
        (
            TeamQuota(concurrent_gpus=16),
            12,
            0,
            8,
            "team vision holds 12 of its 16 concurrent GPUs, job needs 8",
        ),
        (TeamQuota(gpu_hours=100, window_s=86400), 0, 99.9, 8, None),
        (
            TeamQuota(gpu_hours=100, window_s=86400),
            0,
            100.0,
            8,
            "team vision used 100.0 of its 100 GPU-hours in the last 24 h",
        ),
        (TeamQuota(gpu_hours=100, window_s=86400), 0, 100.0, 0, None),  # CPU-only jobs
    ],
)
def test_quota_refusal(
    quota: TeamQuota, held: int, hours: float, gpus: int, expected: str | None
) -> None:
    config = SchedulingConfig(teams={"vision": quota})
    assert quota_refusal("vision", gpus, {"vision": held}, {"vision": hours}, config) == expected


@pytest.mark.parametrize(
    "quota", [TeamQuota(concurrent_gpus=8), TeamQuota(gpu_hours=10, window_s=H)]
)
def test_a_team_with_a_gpu_quota_states_the_gpus_its_job_trains_on(quota: TeamQuota) -> None:
    config = SchedulingConfig(teams={"vision": quota, "nlp": TeamQuota(weight=2)})
    gpus = {"eu-west": 8, "us-east": 0}  # us-east: CPU workers only
    # No needs, or CPU slots only: every GPU of eu-west uncounted.
    assert uncounted_gpus_refusal("vision", config, {}, gpus) == (
        "team vision has a GPU quota and this job states no GPUs in eu-west (8 GPUs), where "
        "it would train on the region's GPUs without the quota counting them; state them "
        "(needs.gpus, or region_needs.<region>.gpus) and the job waits for its quota"
    )
    # GPUs stated where there are some: counted, so it may run (and wait for its quota).
    assert uncounted_gpus_refusal("vision", config, {"eu-west": 1}, gpus) is None
    # A team without a GPU quota is not counted: nothing to bypass.
    assert uncounted_gpus_refusal("nlp", config, {}, gpus) is None
    assert uncounted_gpus_refusal("unlisted", config, {}, gpus) is None


def test_concurrent_gpus_sum_what_each_team_holds() -> None:
    jobs = [
        job("a", placement=("a", "b"), state=SchedulingState.RUNNING, gpus=4),
        job(
            "b",
            placement=("a",),
            state=SchedulingState.PREEMPTING,
            gpus=2,
            team="nlp",
            min_regions=1,
        ),
        job("c", gpus=8),
    ]
    assert concurrent_gpus(jobs) == {"vision": 8, "nlp": 2}


# -- configuration ----------------------------------------------------------------


def test_scheduling_file_parses() -> None:
    config = parse_scheduling_config(
        "priorities: {production: 100, research: 50}\n"
        "default_priority: research\n"
        "ageing: {every_s: 1800, boost: 5, max_boost: 40}\n"
        "teams:\n"
        "  vision: {concurrent_gpus: 32, gpu_hours: 2000, window_s: 604800}\n"
        "  nlp: {budget: {amount: 500}}\n",
        "scheduling.yaml",
    )
    assert config.priority_of("production") == 100
    assert config.quota_of("vision").concurrent_gpus == 32
    assert config.quota_of("vision").budget is None
    budget = config.quota_of("nlp").budget
    assert budget is not None
    assert (budget.amount, budget.window_s) == (500, 30 * 86400)
    assert config.quota_of("nobody") == TeamQuota()


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            "priorities: {production: 100}\n",
            "scheduling.yaml:1: (document): default_priority 'research' is not one of",
        ),
        (
            "teams:\n  vision: {gpu_hours: 10}\n",
            "scheduling.yaml:2: teams.vision: gpu_hours and window_s go together",
        ),
        (
            "teams:\n  vision: {concurrent_gpus: -1}\n",
            "scheduling.yaml:2: teams.vision.concurrent_gpus:",
        ),
        ("teams:\n  Vision: {concurrent_gpus: 1}\n", "invalid team 'Vision'"),
        ("preemption: {enabeld: true}\n", "scheduling.yaml:1: preemption.enabeld: unknown key"),
        ("ageing: {every_s: 0}\n", "ageing.every_s"),
        ("teams:\n  nlp: {budget: {amount: 0}}\n", "scheduling.yaml:2: teams.nlp.budget.amount:"),
        ("teams:\n  nlp: {budget: {window_s: 60}}\n", "teams.nlp.budget.amount: missing"),
    ],
)
def test_scheduling_file_errors_name_file_line_and_key(text: str, problem: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_scheduling_config(text, "scheduling.yaml")
    assert problem in "\n".join(raised.value.problems)


def test_unknown_priority_class_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown priority class 'urgent'"):
        CONFIG.priority_of("urgent")


# -- queue order ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("waited_h", "ageing", "expected"),
    [
        (0.0, AgeingConfig(), 10),
        (0.99, AgeingConfig(), 10),
        (1.0, AgeingConfig(), 20),
        (10.0, AgeingConfig(), 110),  # past production's 100: it cannot starve
        (10.0, AgeingConfig(max_boost=30), 40),
        (10.0, AgeingConfig(boost=0), 10),
    ],
)
def test_ageing_raises_effective_priority(
    waited_h: float, ageing: AgeingConfig, expected: int
) -> None:
    config = SchedulingConfig(ageing=ageing)
    waiting = job("w", priority="best-effort", submitted=100.0)
    assert effective_priority(waiting, 100.0 + waited_h * H, config) == expected


def test_queue_order_priority_then_fair_share_then_submission() -> None:
    config = SchedulingConfig(teams={"nlp": TeamQuota(weight=2)})
    jobs = [
        job("late-research", submitted=30, team="nlp"),
        job("early-research", submitted=10, team="vision"),
        job("production", submitted=50, priority="production"),
        job("best-effort", submitted=0, priority="best-effort"),
        job("same-team-early", submitted=20, team="nlp"),
        job("running", state=SchedulingState.RUNNING, placement=("a", "b")),
    ]
    # vision holds 8 GPUs (the running job), nlp none: nlp's jobs go first among research.
    order = queue_order(jobs, now=60, held=concurrent_gpus(jobs), config=config)
    assert [r.job.name for r in order] == [
        "production",
        "same-team-early",
        "late-research",
        "early-research",
        "best-effort",
    ]
    assert [r.effective for r in order] == [100, 50, 50, 50, 10]


def test_fair_share_off_means_submission_order_within_a_priority() -> None:
    config = SchedulingConfig(fair_share=False)
    jobs = [job("b", submitted=2, team="nlp"), job("a", submitted=1, team="vision")]
    order = queue_order(jobs, 10, {"vision": 100}, config)
    assert [r.job.name for r in order] == ["a", "b"]


def test_an_aged_low_priority_job_overtakes() -> None:
    jobs = [
        job("old", priority="best-effort", submitted=0),
        job("new", priority="production", submitted=10 * H),
    ]
    assert [r.job.name for r in queue_order(jobs, 10 * H, {}, CONFIG)] == ["old", "new"]
    assert [r.job.name for r in queue_order(jobs, 8 * H, {}, CONFIG)] == ["new", "old"]


# -- gang admission ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "regions", "running", "candidate", "admitted", "blocker", "reason"),
    [
        (
            "all regions fit",
            [region("a"), region("b")],
            [],
            job("j"),
            ("a", "b"),
            Blocker.NONE,
            "admitted on 2 region(s): a, b",
        ),
        (
            "gang: one of two is not enough",
            [region("a"), region("b")],
            [job("r", ("b",), 6, state=SchedulingState.RUNNING, placement=("b",))],
            job("j"),
            (),
            Blocker.CAPACITY,
            "needs 2 region(s) at once, 1 can run it now (a); b: 2 of 8 GPUs free, job needs 4",
        ),
        (
            "min_regions 1 runs where it fits",
            [region("a"), region("b")],
            [job("r", ("b",), 6, state=SchedulingState.RUNNING, placement=("b",))],
            job("j", min_regions=1),
            ("a",),
            Blocker.NONE,
            "admitted on 1 region(s): a",
        ),
        (
            "a region down is not capacity",
            [region("a"), region("b", up=False)],
            [],
            job("j"),
            (),
            Blocker.UNAVAILABLE,
            "needs 2 region(s) at once, 1 can run it now (a); b: region is down",
        ),
        (
            "max_regions bounds the gang",
            [region("a"), region("b"), region("c")],
            [],
            job("j", ("c", "a", "b"), min_regions=1, max_regions=2),
            ("c", "a"),
            Blocker.NONE,
            "admitted on 2 region(s): c, a",
        ),
    ],
)
def test_gang_admission(
    case: str,
    regions: list[Region],
    running: list[Job],
    candidate: Job,
    admitted: tuple[str, ...],
    blocker: Blocker,
    reason: str,
) -> None:
    free = free_capacity(regions, running)
    decision = admit(candidate, regions_map(*regions), free, concurrent_gpus(running), {}, CONFIG)
    assert (decision.regions, decision.blocker, decision.reason) == (admitted, blocker, reason), (
        case
    )


def test_quota_shrinks_the_gang_but_never_below_min_regions() -> None:
    regions = [region("a"), region("b"), region("c")]
    config = SchedulingConfig(teams={"vision": TeamQuota(concurrent_gpus=10)})
    free = free_capacity(regions, [])
    shrunk = admit(
        job("j", ("a", "b", "c"), 4, min_regions=2), regions_map(*regions), free, {}, {}, config
    )
    assert shrunk.regions == ("a", "b")
    assert shrunk.reason == "admitted on 2 region(s): a, b (quota allows 2 of 3)"
    refused = admit(
        job("k", ("a", "b", "c"), 4, min_regions=3), regions_map(*regions), free, {}, {}, config
    )
    assert refused.blocker is Blocker.QUOTA
    assert refused.reason == "team vision holds 0 of its 10 concurrent GPUs, job needs 12"


def test_gpu_hours_quota_stops_admission() -> None:
    config = SchedulingConfig(teams={"vision": TeamQuota(gpu_hours=10, window_s=H)})
    regions = [region("a"), region("b")]
    used = {"vision": 10.5}
    decision = admit(job("j"), regions_map(*regions), free_capacity(regions, []), {}, used, config)
    assert decision.blocker is Blocker.QUOTA
    assert decision.reason == "team vision used 10.5 of its 10 GPU-hours in the last 1 h"


# -- one pass ---------------------------------------------------------------------


def test_pass_admits_in_order_against_what_earlier_admissions_took() -> None:
    regions = [region("a"), region("b")]
    jobs = [
        job("first", gpus=6, priority="production", submitted=5),
        job("second", gpus=4, submitted=0),
        job("small", ("a",), gpus=2, priority="best-effort", submitted=1),
    ]
    decided = plan(10.0, regions, jobs, CONFIG)
    assert [a.job for a in decided.admitted] == ["first", "small"]
    (waiting,) = decided.waiting
    assert waiting.job == "second"
    assert waiting.blocker is Blocker.CAPACITY
    assert waiting.reason.startswith("needs 2 region(s) at once, 0 can run it now")
    assert decided.preempted == ()  # nothing is running, no one to preempt


def test_a_job_waiting_past_reserve_after_holds_back_its_capacity() -> None:
    config = SchedulingConfig(reserve_after_s=H)
    regions = [region("a")]
    running = job(
        "r", ("a",), 6, state=SchedulingState.RUNNING, placement=("a",), priority="production"
    )
    big = job("big", ("a",), 4, submitted=0, priority="best-effort")
    small = job("small", ("a",), 2, submitted=1, priority="best-effort")
    early = plan(30 * 60.0, regions, [running, big, small], config)
    assert [a.job for a in early.admitted] == ["small"]  # backfill while big is young
    late = plan(2 * H, regions, [running, big, small], config)
    assert late.admitted == ()
    assert "capacity held back for it after 7200 s" in late.waiting[0].reason
    # Off by default: the small job fills in.
    assert [a.job for a in plan(2 * H, regions, [running, big, small], CONFIG).admitted] == [
        "small"
    ]
    # A hold binds the holder's class and below, not a higher class.
    urgent = job("urgent", ("a",), 2, submitted=2 * H, priority="research")
    held = plan(2 * H, regions, [running, big, urgent], config)
    assert [a.job for a in held.admitted] == ["urgent"]


def test_only_max_reservations_jobs_hold_capacity() -> None:
    config = SchedulingConfig(reserve_after_s=0, max_reservations=1)
    regions = [region("a"), region("b")]
    running = [
        job(
            "ra", ("a",), 6, state=SchedulingState.RUNNING, placement=("a",), priority="production"
        ),
        job(
            "rb", ("b",), 6, state=SchedulingState.RUNNING, placement=("b",), priority="production"
        ),
    ]
    first = job("first", ("a",), 4, submitted=0)
    second = job("second", ("b",), 4, submitted=1)
    filler = job("filler", ("a", "b"), 2, submitted=2, min_regions=1)
    decided = plan(10.0, regions, [*running, first, second, filler], config)
    assert [(a.job, a.regions) for a in decided.admitted] == [("filler", ("b",))]


def test_pass_refuses_duplicate_job_names() -> None:
    with pytest.raises(ValueError, match="unique"):
        plan(0.0, [region("a")], [job("x", ("a",)), job("x", ("a",))], CONFIG)


def test_job_validation() -> None:
    with pytest.raises(ValueError, match="min_regions"):
        job("j", ("a",), min_regions=2)
    with pytest.raises(ValueError, match="holds regions"):
        job("j", state=SchedulingState.RUNNING)
    with pytest.raises(ValueError, match="does not list"):
        job("j", ("a",), state=SchedulingState.RUNNING, placement=("z",))
    with pytest.raises(ValueError, match="at least one GPU"):
        RegionNeed()


def test_a_preempting_job_still_holds_its_regions() -> None:
    regions = [region("a")]
    stopping = job("s", ("a",), 8, state=SchedulingState.PREEMPTING, placement=("a",))
    decided = plan(0.0, regions, [stopping, job("n", ("a",), 8, priority="production")], CONFIG)
    assert decided.admitted == ()
    assert "fits once preempting jobs stop: s" in decided.waiting[0].reason
    assert decided.waiting[0].claim == ("a",)
