"""Capacity admission: the spec's scheduling keys, the pure pass, what regions show.

Table-driven over :func:`coordinator.jobs.capacity.admission_pass`: who starts, who waits
with which reason and place, what holds capacity (running and paused jobs, in all their
regions), what does not (jobs without needs), and how unknown or down regions count.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.jobs.capacity import (
    JobFacts,
    RegionFacts,
    admission_pass,
    capacity_json,
    in_use,
    job_facts,
    training_phase,
    without_preemption,
)
from coordinator.jobs.spec import DEFAULT_TEAM, JobSpecError, parse_job_spec, parse_stored_spec
from coordinator.rounds.driver import Step, next_step
from coordinator.rounds.records import JobState
from coordinator.scheduling import RegionNeed, SchedulingConfig
from coordinator.scheduling.config import load_scheduling_config
from geofed.control import Capacity, RegionStatus, decode, encode
from geofed_cli.queue import queue_rows, queue_text, wait_text
from regional_agent.status import worker_slots

SPEC = """\
job: tiny
task:
  spec: tests.support.tiny_task:TinyTask
regions:
  eu-west: [eu-parliament-proceedings]
  us-east: [us-public-domain-books]
rounds: 3
inner_steps: 2
checkpoint_storage: [eu-ckpt]
"""
CONFIG = without_preemption(SchedulingConfig())
ONE_SLOT = Capacity(cpu_slots=1)
SLOT = {"eu-west": RegionNeed(cpu_slots=1), "us-east": RegionNeed(cpu_slots=1)}


def _problems(text: str) -> tuple[str, ...]:
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(text, "job.yaml")
    return caught.value.problems


# -- the job spec ------------------------------------------------------------------------


def test_a_spec_without_scheduling_keys_is_not_capacity_scheduled() -> None:
    spec = parse_job_spec(SPEC, "job.yaml")
    assert (spec.priority, spec.team, spec.needs, spec.region_needs) == (None, None, None, {})
    facts = job_facts(spec, JobState.RUNNING, 5.0, CONFIG)
    assert (facts.priority, facts.team, facts.scheduled) == ("research", DEFAULT_TEAM, False)


def test_needs_priority_and_team_are_read_and_survive_storage() -> None:
    text = SPEC + (
        "priority: production\nteam: vision\nneeds: {cpu_slots: 2}\n"
        "region_needs: {us-east: {gpus: 4, gpu_kind: H100, min_gpu_memory_gib: 40}}\n"
    )
    spec = parse_stored_spec(parse_job_spec(text, "job.yaml").to_json())
    facts = job_facts(spec, JobState.QUEUED, 1.0, CONFIG)
    assert (facts.priority, facts.team, facts.min_regions) == ("production", "vision", 2)
    assert facts.needs == {
        "eu-west": RegionNeed(cpu_slots=2),
        "us-east": RegionNeed(gpus=4, gpu_kind="H100", min_gpu_memory_gib=40),
    }


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("needs: {gpus: 0}\n", "job.yaml:10: needs: a need asks for at least one GPU"),
        ("needs: {cpu_slots: 1, gpu_kind: H100}\n", "gpu_kind and min_gpu_memory_gib apply"),
        ("needs: {cpu_slots: -1}\n", "job.yaml:10: needs.cpu_slots: "),
        ("needs: {slots: 1}\n", "job.yaml:10: needs.slots: "),
        ("priority: Not_A_Name\n", "job.yaml:10: priority: "),
        ("team: ''\n", "job.yaml:10: team: "),
        (
            "needs: {cpu_slots: 1}\nregion_needs: {ap-south: {cpu_slots: 1}}\n",
            "region_needs names ['ap-south'], which are not among the job's regions",
        ),
        ("region_needs: {eu-west: {cpu_slots: 1}}\n", "region_needs refines needs"),
    ],
)
def test_scheduling_keys_are_validated_with_file_line_and_key(extra: str, expected: str) -> None:
    problems = _problems(SPEC + extra)
    assert any(expected in problem for problem in problems), problems


def test_a_priority_class_no_longer_configured_falls_back_to_the_default() -> None:
    spec = parse_job_spec(SPEC + "priority: gone\nneeds: {cpu_slots: 1}\n", "job.yaml")
    assert job_facts(spec, JobState.QUEUED, 0.0, CONFIG).priority == "research"


def test_the_scheduling_file_is_optional_and_validated(tmp_path: Path) -> None:
    assert load_scheduling_config(None) == SchedulingConfig()
    path = tmp_path / "scheduling.yaml"
    path.write_text("priorities: {urgent: 9, low: 1}\ndefault_priority: low\n")
    assert load_scheduling_config(path).priority_of("urgent") == 9
    path.write_text("priorities: {urgent: 9}\n")
    with pytest.raises(Exception, match="default_priority 'research' is not one of"):
        load_scheduling_config(path)
    with pytest.raises(Exception, match="cannot read"):
        load_scheduling_config(tmp_path / "missing.yaml")


# -- the admission pass ------------------------------------------------------------------


def job(
    name: str,
    state: JobState = JobState.QUEUED,
    *,
    at: float = 0.0,
    priority: str = "research",
    needs: dict[str, RegionNeed] | None = None,
    min_regions: int = 2,
) -> JobFacts:
    return JobFacts(
        name=name,
        state=state,
        priority=priority,
        team="t",
        regions=("eu-west", "us-east"),
        min_regions=min_regions,
        needs=SLOT if needs is None else needs,
        submitted_at=at,
    )


def up(capacity: Capacity | None = ONE_SLOT) -> list[RegionFacts]:
    return [RegionFacts("eu-west", True, capacity), RegionFacts("us-east", True, capacity)]


CASES = [
    # (what, regions, jobs, started, waiting: {job: (position, reason part)})
    ("a job that fits starts", up(), [job("a")], ["a"], {}),
    (
        "one slot per region: the first submitted starts, the second waits",
        up(),
        [job("b", at=2.0), job("a", at=1.0)],
        ["a"],
        {"b": (1, "0 of 1 CPU worker slots free, job needs 1")},
    ),
    (
        "a running job holds its regions",
        up(),
        [job("a", JobState.RUNNING), job("b")],
        [],
        {"b": (1, "needs 2 region(s) at once, 0 can run it now")},
    ),
    (
        "so does a paused one",
        up(),
        [job("a", JobState.PAUSED), job("b")],
        [],
        {"b": (1, "0 of 1 CPU worker slots free")},
    ),
    (
        "an ended job holds nothing",
        up(),
        [job("a", JobState.COMPLETED), job("c", JobState.CANCELLED), job("b")],
        ["b"],
        {},
    ),
    (
        "a job without needs neither waits nor holds",
        up(),
        [job("free", JobState.RUNNING, needs={}), job("nf", needs={}), job("b")],
        ["b"],
        {},
    ),
    (
        "a higher priority goes first",
        up(),
        [job("a", at=1.0), job("p", at=2.0, priority="production")],
        ["p"],
        {"a": (1, "0 of 1 CPU worker slots free")},
    ),
    (
        "unknown capacity (an agent that predates it) is unlimited, of any GPU kind",
        up(None),
        [
            job("a", JobState.RUNNING),
            job("g", needs={r: RegionNeed(gpus=8, gpu_kind="H100") for r in SLOT}),
        ],
        ["g"],
        {},
    ),
    (
        "a region that is down (or never reported) keeps a gang of 2 waiting",
        [RegionFacts("eu-west", True, ONE_SLOT), RegionFacts("us-east", False, None)],
        [job("a")],
        [],
        {"a": (1, "us-east: region is down")},
    ),
    (
        "min_regions 1: one region that fits is enough",
        [RegionFacts("eu-west", True, ONE_SLOT), RegionFacts("us-east", False, None)],
        [job("a", min_regions=1)],
        ["a"],
        {},
    ),
    (
        "a need the region can never meet is said so",
        up(Capacity(gpus=2, gpu_kind="A100", gpu_memory_gib=40.0, cpu_slots=2)),
        [job("g", needs={r: RegionNeed(gpus=1, gpu_kind="H100") for r in SLOT})],
        [],
        {"g": (1, "has A100 GPUs, job needs H100")},
    ),
    (
        "several wait, in queue order",
        up(),
        [job("a", JobState.RUNNING), job("c", at=3.0), job("b", at=2.0)],
        [],
        {"b": (1, "free"), "c": (2, "free")},
    ),
]


@pytest.mark.parametrize(
    ("regions", "jobs", "started", "waiting"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_admission_pass(
    regions: list[RegionFacts],
    jobs: list[JobFacts],
    started: list[str],
    waiting: dict[str, tuple[int, str]],
) -> None:
    decided = admission_pass(10.0, regions, jobs, CONFIG)
    assert [start.job for start in decided.starts] == started
    for start in decided.starts:
        assert start.reason.startswith("admitted on"), start
    assert set(decided.queue) == set(waiting)
    for name, (position, reason) in waiting.items():
        entry = decided.queue[name]
        assert entry.position == position
        assert reason in entry.reason, entry.reason
        assert entry.since == next(j.submitted_at for j in jobs if j.name == name)


def test_the_queue_entry_is_what_the_api_shows() -> None:
    decided = admission_pass(10.0, up(), [job("a", JobState.RUNNING), job("b", at=60.0)], CONFIG)
    shown = decided.queue["b"].as_dict()
    assert set(shown) == {"position", "reason", "since"}
    assert shown["since"] == "1970-01-01T00:01:00+00:00"


def test_in_use_counts_the_running_and_paused_jobs_that_state_needs() -> None:
    jobs = [
        job("a", JobState.RUNNING),
        job("p", JobState.PAUSED, needs={r: RegionNeed(gpus=2) for r in SLOT}),
        job("q"),
        job("free", JobState.RUNNING, needs={}),
    ]
    assert in_use("eu-west", jobs) == {"gpus": 2, "cpu_slots": 1, "jobs": ["a", "p"]}
    assert in_use("ap-south", jobs) == {"gpus": 0, "cpu_slots": 0, "jobs": []}
    assert capacity_json(None) is None
    assert capacity_json(Capacity(gpus=1, gpu_kind="H100", gpu_memory_gib=80.0)) == {
        "gpus": 1,
        "gpu_kind": "H100",
        "gpu_memory_gib": 80.0,
        "cpu_slots": 0,
    }


def test_a_queued_job_has_no_round_to_drive() -> None:
    step, reason = next_step(
        0.0, JobState.QUEUED, 0, 3, None, None, failures=0, max_round_attempts=3
    )
    assert step is Step.QUEUED
    assert "queue" in reason


# -- the agent's side ----------------------------------------------------------------------


def test_capacity_travels_in_the_status_and_old_statuses_have_none() -> None:
    status = RegionStatus(
        region="eu", state="online", agent_version="1", capacity=Capacity(cpu_slots=2)
    )
    assert decode(encode(status), RegionStatus).capacity == Capacity(cpu_slots=2)
    old = b'{"type":"region_status","message_id":"8d4f7a4e-3c55-4b8c-9d7a-8c1b1e2a3f40",'
    old += b'"sent_at":"2026-11-24T18:00:00Z","region":"eu","state":"online","agent_version":"0"}'
    assert decode(old, RegionStatus).capacity is None


@pytest.mark.parametrize(
    ("workers", "backend", "gpus", "slots"),
    [(3, "gloo", 0, 3), ("auto", "auto", 0, 2), ("auto", "auto", 4, 4), ("auto", "gloo", 4, 2)],
)
def test_worker_slots_resolve_auto_as_the_launcher_does(
    workers: int | str, backend: str, gpus: int, slots: int
) -> None:
    assert worker_slots(workers, backend, gpus) == slots


# -- geofed queue ----------------------------------------------------------------------------


def test_the_queue_table_shows_place_priority_team_wait_estimate_and_reason() -> None:
    rows = queue_rows(
        [
            {
                "job": "b",
                "state": "queued",
                "priority": "production",
                "team": "nlp",
                "position": 1,
                "reason": "needs 2 region(s) at once",
                "wait_s": 185.2,
                "cost_estimate": {
                    "currency": "USD",
                    "amount": 120.0,
                    "reason": "...",
                    "budget": {"amount": 500.0, "expected": 120.0, "within": True, "basis": "..."},
                },
            },
            {"job": "a", "state": "running", "priority": "research", "team": "default"},
            {
                "job": "c",
                "state": "running",
                "cost_estimate": {"currency": "EUR", "amount": 7.5, "reason": "", "budget": None},
            },
        ]
    )
    assert rows[1] == (
        "1",
        "b",
        "queued",
        "production",
        "nlp",
        "3m05s",
        "120.00/500 USD",
        "needs 2 region(s) at once",
    )
    assert rows[2] == ("-", "a", "running", "research", "default", "-", "-", "-")
    assert rows[3][6] == "7.50 EUR"
    assert queue_text(rows).splitlines()[0].startswith("POSITION  JOB  STATE")
    assert [wait_text(s) for s in (5, 3600 * 2 + 7 * 60, None)] == ["5s", "2h07m", "-"]


def test_the_example_scheduling_file_parses() -> None:
    path = Path(__file__).resolve().parents[2] / "configs" / "scheduling.yaml"
    config = load_scheduling_config(path)
    assert config.default_priority == "research"
    assert config.quota_of("vision").concurrent_gpus == 32


# -- preemption at the round boundary ------------------------------------------------------


def test_the_training_phase_counts_rounds_between_snapshots() -> None:
    phase = training_phase(7, 5, in_round=True)
    assert (phase.rounds_since_snapshot, phase.rounds_to_snapshot) == (2, 3)
    assert phase.round_in_progress
    assert training_phase(10, 5, in_round=False).rounds_to_snapshot == 5


PREEMPTIBLE = training_phase(1, 10, in_round=True)


@pytest.mark.parametrize(
    ("victim", "claimant", "preempted", "reason"),
    [
        (
            None,
            "production",
            {"r"},
            "preempting r at their round boundary",
        ),
        (None, "research", set(), "r (research) is not 1 below research"),  # same class: it waits
        (
            "near-snapshot",
            "production",
            set(),
            "next snapshot is 1 round(s) after its next boundary",
        ),
        ("preempting", "production", set(), "fits once preempting jobs stop: r"),
    ],
    ids=[
        "a higher class stops a lower one",
        "never an equal class",
        "not before a snapshot",
        "a victim already stopping is not stopped twice",
    ],
)
def test_preemption(victim: str | None, claimant: str, preempted: set[str], reason: str) -> None:
    phase = training_phase(8, 10, in_round=True) if victim == "near-snapshot" else PREEMPTIBLE
    running = JobFacts(
        name="r",
        state=JobState.RUNNING,
        priority="research",
        team="t",
        regions=("eu-west", "us-east"),
        min_regions=2,
        needs=SLOT,
        submitted_at=0.0,
        phase=phase,
        preempting=victim == "preempting",
    )
    decided = admission_pass(
        10.0, up(), [running, job("p", at=5.0, priority=claimant)], SchedulingConfig()
    )
    assert set(decided.preempt) == preempted
    assert reason in decided.queue["p"].reason, decided.queue["p"].reason
    if preempted:
        assert decided.claims == {"p": ("eu-west", "us-east")}
        assert "stopped at its next round boundary for p" in decided.preempt["r"]


def test_a_claim_holds_the_freed_capacity_for_the_job_that_preempted() -> None:
    config = SchedulingConfig()
    back = job("r", at=0.0)  # the victim, back in the queue, older than the claimant
    claimant = JobFacts(
        name="p",
        state=JobState.QUEUED,
        priority="research",
        team="t",
        regions=("eu-west", "us-east"),
        min_regions=2,
        needs=SLOT,
        submitted_at=5.0,
        claim=("eu-west", "us-east"),
    )
    decided = admission_pass(10.0, up(), [back, claimant], config)
    assert [start.job for start in decided.starts] == ["p"]
    assert list(decided.queue) == ["r"]
