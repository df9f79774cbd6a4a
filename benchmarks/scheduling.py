"""Multi-job scheduling: queue wait, utilisation, preemptions and lost work in simulation.

    python -m benchmarks.scheduling [--jobs 300] [--regions 3,5,8] [--seeds 0,1,2]
        [--load 0.7] [--smoke] [--out PATH] [--note TEXT]

A simulated workload, decided by the scheduler's own pure functions
(:func:`coordinator.scheduling.plan`), with no sockets and a seeded RNG. For each
federation of R regions and each seed, one job list and one failure trace are drawn and
run under each policy:

* ``fifo``: the baseline. Submission order, no priorities, no ageing, no fair share, no
  preemption; the first job that cannot start holds back the capacity it needs at once,
  so later jobs cannot overtake it into that capacity (they may use what it does not
  need: FIFO with backfill around the head of the queue).
* ``priority``: the scheduler's defaults: priority classes with ageing, fair share,
  gang admission, and preemption at the victim's next round boundary outside the
  snapshot window; lower jobs fill in wherever a blocked job cannot start.
* ``priority_reserve``: the same, with capacity held back for the first job that has
  waited over an hour (``reserve_after_s: 3600``) against jobs of its class and below.
* ``priority_immediate``: the same decisions, but a victim is stopped at once instead of
  at its round boundary: it resumes from its last snapshot, so it loses the rounds since
  then and the round in progress. Shown for contrast only; the scheduler never does it.

The simulation advances in steps of 60 s. A job runs ``rounds`` rounds of ``round_s``
seconds on every region it was admitted to; every ``k``-th round also takes its snapshot
cost δ, with ``k`` from :func:`coordinator.scheduling.snapshot_interval` for δ and the
combined MTBF of the job's regions. Regions fail (exponential, MTBF ``--mtbf-h``) and
come back after ``--downtime-min``; a job on a failing region loses the round in
progress and the rounds since its last snapshot and queues again. Arrivals are Poisson
over ``--arrival-h`` hours at the rate that offers ``--load`` times the federation's GPUs
(counting every listed region). Queue wait is from submission to first start;
utilisation is GPU-seconds held by jobs over the GPUs of the federation times the time
from the first arrival to the last completion ("useful" leaves out work later lost;
"while arriving" counts only the time until the last arrival, without the drain).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks._machine import describe_machine, machine_line, targets_table
from benchmarks._report import publish
from coordinator.scheduling import (
    AgeingConfig,
    Job,
    PreemptionConfig,
    Region,
    RegionCapacity,
    RegionNeed,
    SchedulingConfig,
    SchedulingState,
    TeamQuota,
    TrainingPhase,
    combined_mtbf,
    lost_rounds,
    plan,
    snapshot_interval,
)

RESULTS = Path(__file__).resolve().parent / "results"
STEP_S = 60
POLICIES = ("fifo", "priority", "priority_reserve", "priority_immediate")
RESERVE_AFTER_S = 3600
PRIORITY_MIX = {"production": 0.2, "research": 0.5, "best-effort": 0.3}
TEAMS = ("vision", "language", "speech")
GPU_SIZES = (1, 2, 4, 8)
GPU_WEIGHTS = (0.3, 0.35, 0.25, 0.1)
REPLAN_EVERY_S = 600  # a pass also runs this often without events, for ageing


@dataclass(frozen=True, slots=True)
class JobDraw:
    """One job of the workload, as submitted."""

    name: str
    team: str
    priority: str
    submitted_at: float
    regions: tuple[str, ...]
    min_regions: int
    gpus: int
    rounds: int
    round_s: int
    snapshot_cost_s: int
    snapshot_every: int


@dataclass(frozen=True, slots=True)
class Workload:
    regions: tuple[Region, ...]
    jobs: tuple[JobDraw, ...]
    failures: tuple[tuple[float, str], ...]  # (time, region), sorted
    downtime_s: float


@dataclass(slots=True)
class Running:
    """A job's simulated progress."""

    draw: JobDraw
    state: SchedulingState = SchedulingState.QUEUED
    placement: tuple[str, ...] = ()
    first_start: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    rounds_done: int = 0
    since_snapshot: int = 0
    progress_s: float = 0.0
    gpu_s_since_snapshot: float = 0.0
    preemptions: int = 0
    claim: tuple[str, ...] = ()

    def round_length(self) -> float:
        snapshot = (self.since_snapshot + 1) % self.draw.snapshot_every == 0
        return self.draw.round_s + (self.draw.snapshot_cost_s if snapshot else 0)

    def phase(self) -> TrainingPhase:
        every = self.draw.snapshot_every
        return TrainingPhase(
            rounds_since_snapshot=self.since_snapshot,
            rounds_to_snapshot=every - self.since_snapshot % every,
            round_in_progress=True,
        )

    def as_job(self) -> Job:
        draw = self.draw
        return Job(
            name=draw.name,
            team=draw.team,
            priority=draw.priority,
            submitted_at=draw.submitted_at,
            regions=draw.regions,
            need=RegionNeed(gpus=draw.gpus),
            min_regions=draw.min_regions,
            state=self.state,
            placement=self.placement,
            phase=None if self.state is SchedulingState.QUEUED else self.phase(),
            started_at=self.started_at,
            claim=self.claim if self.state is SchedulingState.QUEUED else (),
        )


@dataclass(slots=True)
class Tally:
    held_gpu_s: float = 0.0
    held_gpu_s_arriving: float = 0.0  # while jobs still arrive (the steady state)
    wasted_gpu_s: float = 0.0
    preemptions: int = 0
    rounds_lost_preemption: int = 0
    rounds_lost_failure: int = 0
    passes: int = 0
    decide_s: float = 0.0
    lost_per_preemption: list[int] = field(default_factory=list)
    since_snapshot_at_stop: list[int] = field(default_factory=list)


# -- the workload ---------------------------------------------------------------------


def draw_workload(
    seed: int,
    regions: int,
    jobs: int,
    *,
    load: float,
    arrival_h: float,
    mtbf_h: float,
    downtime_min: float,
) -> Workload:
    """Draw regions, jobs and failures; the same for every policy."""
    rng = random.Random(seed * 1000 + regions)
    names = [f"region-{i}" for i in range(regions)]
    region_list = tuple(
        Region(name, RegionCapacity(gpus=rng.choice((8, 16, 32)), gpu_kind="h100"))
        for name in names
    )
    capacity = sum(r.capacity.gpus for r in region_list)
    mtbf_s = mtbf_h * 3600
    horizon = arrival_h * 3600
    shapes = []
    for _ in range(jobs):
        count = rng.randint(1, min(4, regions))
        listed = tuple(rng.sample(names, count))
        gpus = rng.choices(GPU_SIZES, GPU_WEIGHTS)[0]
        round_s = 60 * rng.randint(5, 15)
        cost = rng.randint(30, 120)
        interval = snapshot_interval(
            cost,
            combined_mtbf([mtbf_s] * count),
            round_s,
            min_rounds=1,
            max_rounds=20,
        )
        shapes.append(
            (
                listed,
                rng.randint(1, count),
                gpus,
                rng.randint(6, 40),
                round_s,
                cost,
                interval.rounds,
                rng.choices(list(PRIORITY_MIX), list(PRIORITY_MIX.values()))[0],
                rng.choice(TEAMS),
            )
        )
    # Offered GPU-seconds over the arrival window, every listed region counted.
    offered = sum(len(s[0]) * s[2] * s[3] * s[4] for s in shapes)
    mean_gap = horizon / jobs * (offered / (load * capacity * horizon))
    t = 0.0
    drawn = []
    for index, shape in enumerate(shapes):
        t += rng.expovariate(1 / mean_gap)
        listed, min_regions, gpus, rounds, round_s, cost, every, priority, team = shape
        drawn.append(
            JobDraw(
                f"job-{index:03d}",
                team,
                priority,
                round(t / STEP_S) * STEP_S,
                listed,
                min_regions,
                gpus,
                rounds,
                round_s,
                cost,
                every,
            )
        )
    failures = []
    end = t * 3 + 30 * 86400
    for name in names:
        at = rng.expovariate(1 / mtbf_s)
        while at < end:
            failures.append((math.floor(at / STEP_S) * STEP_S, name))
            at += downtime_min * 60 + rng.expovariate(1 / mtbf_s)
    failures.sort()
    return Workload(region_list, tuple(drawn), tuple(failures), downtime_min * 60)


def policy_config(policy: str, workload: Workload) -> SchedulingConfig:
    """The scheduler's settings for ``policy``; the team quotas are the same for all."""
    capacity = sum(r.capacity.gpus for r in workload.regions)
    # Each team may hold up to 60% of the federation: the quota binds only under
    # contention, and it binds the same way in every policy.
    teams = {team: TeamQuota(concurrent_gpus=math.ceil(0.6 * capacity)) for team in TEAMS}
    if policy == "fifo":
        return SchedulingConfig(
            priorities=dict.fromkeys(PRIORITY_MIX, 0),
            default_priority="research",
            ageing=AgeingConfig(boost=0),
            fair_share=False,
            reserve_after_s=0,
            preemption=PreemptionConfig(enabled=False),
            teams=teams,
        )
    if policy == "priority_reserve":
        return SchedulingConfig(teams=teams, reserve_after_s=RESERVE_AFTER_S)
    return SchedulingConfig(teams=teams)


# -- the simulation -------------------------------------------------------------------


def simulate(workload: Workload, policy: str, *, max_days: float = 60) -> dict[str, Any]:
    """Run ``workload`` under ``policy``; return its figures."""
    config = policy_config(policy, workload)
    immediate = policy == "priority_immediate"
    jobs = {d.name: Running(d) for d in workload.jobs}
    pending = sorted(workload.jobs, key=lambda d: d.submitted_at)
    arrived = 0
    down_until: dict[str, float] = {}
    failures = list(workload.failures)
    failure_index = 0
    tally = Tally()
    capacity = sum(r.capacity.gpus for r in workload.regions)
    start = pending[0].submitted_at
    last_arrival = pending[-1].submitted_at
    now = start
    last_pass = -math.inf
    limit = start + max_days * 86400
    while now <= limit:
        event = False
        # Arrivals.
        while arrived < len(pending) and pending[arrived].submitted_at <= now:
            arrived += 1
            event = True
        # Recoveries and failures.
        for name in [n for n, until in down_until.items() if until <= now]:
            del down_until[name]
            event = True
        while failure_index < len(failures) and failures[failure_index][0] <= now:
            _, region = failures[failure_index]
            failure_index += 1
            event = True
            down_until[region] = now + workload.downtime_s
            for job in jobs.values():
                if job.state is not SchedulingState.QUEUED and region in job.placement:
                    tally.rounds_lost_failure += job.since_snapshot + 1
                    tally.wasted_gpu_s += job.gpu_s_since_snapshot
                    _roll_back(job)
        live = [j for j in jobs.values() if j.finished_at is None and j.draw.submitted_at <= now]
        if not live and arrived == len(pending):
            break
        if event or now - last_pass >= REPLAN_EVERY_S:
            regions = [
                dataclasses.replace(r, up=r.name not in down_until) for r in workload.regions
            ]
            began = time.perf_counter()
            decided = plan(now, regions, [j.as_job() for j in live], config)
            tally.decide_s += time.perf_counter() - began
            tally.passes += 1
            last_pass = now
            for victim in decided.preempted:
                job = jobs[victim.job]
                tally.preemptions += 1
                job.preemptions += 1
                if immediate:
                    lost = lost_rounds(job.as_job(), at_boundary=False)
                    tally.rounds_lost_preemption += lost
                    tally.lost_per_preemption.append(lost)
                    tally.wasted_gpu_s += job.gpu_s_since_snapshot
                    _roll_back(job)
                else:
                    job.state = SchedulingState.PREEMPTING
            for wait in decided.waiting:
                jobs[wait.job].claim = wait.claim
            for admission in decided.admitted:
                job = jobs[admission.job]
                job.claim = ()
                job.state = SchedulingState.RUNNING
                job.placement = admission.regions
                job.started_at = now
                if job.first_start is None:
                    job.first_start = now
        # Advance every job holding regions by one step.
        for job in jobs.values():
            if job.state is SchedulingState.QUEUED:
                continue
            gpu_s = job.draw.gpus * len(job.placement) * STEP_S
            tally.held_gpu_s += gpu_s
            if now < last_arrival:
                tally.held_gpu_s_arriving += gpu_s
            job.gpu_s_since_snapshot += gpu_s
            job.progress_s += STEP_S
            if job.progress_s < job.round_length():
                continue
            job.progress_s -= job.round_length()
            job.rounds_done += 1
            job.since_snapshot += 1
            if job.since_snapshot % job.draw.snapshot_every == 0:
                job.since_snapshot = 0
                job.gpu_s_since_snapshot = 0.0
            if job.rounds_done >= job.draw.rounds:
                job.finished_at = now + STEP_S
                job.state = SchedulingState.QUEUED
                job.placement = ()
            elif job.state is SchedulingState.PREEMPTING:
                # At the boundary: the round is published and the regional state saved,
                # so it resumes from here.
                lost = lost_rounds(job.as_job(), at_boundary=True)
                tally.since_snapshot_at_stop.append(job.since_snapshot)
                tally.rounds_lost_preemption += lost
                tally.lost_per_preemption.append(lost)
                job.state = SchedulingState.QUEUED
                job.placement = ()
                job.progress_s = 0.0
        now += STEP_S
    return _figures(jobs, tally, capacity, start, last_arrival)


def _roll_back(job: Running) -> None:
    """Back to the last snapshot, queued again."""
    job.rounds_done -= job.since_snapshot
    job.since_snapshot = 0
    job.progress_s = 0.0
    job.gpu_s_since_snapshot = 0.0
    job.state = SchedulingState.QUEUED
    job.placement = ()


def _figures(
    jobs: dict[str, Running], tally: Tally, capacity: int, start: float, last_arrival: float
) -> dict[str, Any]:
    finished = [j for j in jobs.values() if j.finished_at is not None]
    end = max((j.finished_at or start for j in finished), default=start)
    span = max(end - start, STEP_S)
    waits: dict[str, list[float]] = {p: [] for p in PRIORITY_MIX}
    for job in jobs.values():
        if job.first_start is not None:
            waits[job.draw.priority].append(job.first_start - job.draw.submitted_at)
    return {
        "jobs": len(jobs),
        "finished": len(finished),
        "never_started": sum(1 for j in jobs.values() if j.first_start is None),
        "makespan_h": span / 3600,
        "wait_s": waits,
        "utilisation": tally.held_gpu_s / (capacity * span),
        "useful_utilisation": (tally.held_gpu_s - tally.wasted_gpu_s) / (capacity * span),
        "utilisation_while_arriving": tally.held_gpu_s_arriving
        / (capacity * max(last_arrival - start, STEP_S)),
        "preemptions": tally.preemptions,
        "rounds_lost_to_preemption": tally.rounds_lost_preemption,
        "max_rounds_lost_per_preemption": max(tally.lost_per_preemption, default=0),
        "rounds_lost_to_failures": tally.rounds_lost_failure,
        "since_snapshot_at_stop": tally.since_snapshot_at_stop,
        "passes": tally.passes,
        "decide_ms_per_pass": 1000 * tally.decide_s / max(tally.passes, 1),
    }


# -- the report -----------------------------------------------------------------------


def p95(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool the seeds of one (regions, policy): waits pooled, counts summed."""
    waits = {p: [w for r in runs for w in r["wait_s"][p]] for p in PRIORITY_MIX}
    return {
        "wait_mean_min": {p: (statistics.fmean(w) / 60 if w else None) for p, w in waits.items()},
        "wait_p95_min": {
            p: (v / 60 if (v := p95(w)) is not None else None) for p, w in waits.items()
        },
        "jobs_per_priority": {p: len(w) for p, w in waits.items()},
        "utilisation": statistics.fmean(r["utilisation"] for r in runs),
        "useful_utilisation": statistics.fmean(r["useful_utilisation"] for r in runs),
        "utilisation_while_arriving": statistics.fmean(
            r["utilisation_while_arriving"] for r in runs
        ),
        "makespan_h": statistics.fmean(r["makespan_h"] for r in runs),
        "preemptions": sum(r["preemptions"] for r in runs),
        "rounds_lost_to_preemption": sum(r["rounds_lost_to_preemption"] for r in runs),
        "max_rounds_lost_per_preemption": max(r["max_rounds_lost_per_preemption"] for r in runs),
        "rounds_lost_to_failures": sum(r["rounds_lost_to_failures"] for r in runs),
        "mean_rounds_since_snapshot_at_stop": _mean(
            [n for r in runs for n in r["since_snapshot_at_stop"]]
        ),
        "finished": sum(r["finished"] for r in runs),
        "jobs": sum(r["jobs"] for r in runs),
        "never_started": sum(r["never_started"] for r in runs),
        "longest_wait_h": max((w for ws in waits.values() for w in ws), default=0.0) / 3600,
        "decide_ms_per_pass": statistics.fmean(r["decide_ms_per_pass"] for r in runs),
    }


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        "# Multi-job scheduling (simulated)",
        "",
        f"Machine: {machine_line(report['machine'])}.",
        "",
        f"Workload per federation and seed: {s['jobs']} jobs arriving over {s['arrival_h']:g} h "
        f"(offered load {s['load']:g} x the federation's GPUs), priorities "
        + ", ".join(f"{p} {f:.0%}" for p, f in PRIORITY_MIX.items())
        + f"; 1-4 regions listed per job, min_regions 1..listed, {'/'.join(map(str, GPU_SIZES))} "
        f"GPUs per region, 6-40 rounds of 5-15 min; regions of 8/16/32 GPUs failing with "
        f"MTBF {s['mtbf_h']:g} h, down {s['downtime_min']:g} min; seeds {s['seeds']}. "
        f"Waits pooled over seeds; utilisation is the mean over seeds.",
        "",
        "| regions | policy | mean wait production / research / best-effort (min) "
        "| p95 wait (min) | GPU utilisation (useful) | while arriving | preemptions "
        "| rounds lost to preemption | rounds lost to failures | longest wait h | makespan h |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for regions, policies in report["results"].items():
        for policy, r in policies.items():
            means = " / ".join(_fmt(r["wait_mean_min"][p]) for p in PRIORITY_MIX)
            tails = " / ".join(_fmt(r["wait_p95_min"][p]) for p in PRIORITY_MIX)
            lines.append(
                f"| {regions} | {policy} | {means} | {tails} | {r['utilisation']:.1%} "
                f"({r['useful_utilisation']:.1%}) | {r['utilisation_while_arriving']:.1%} | "
                f"{r['preemptions']} | "
                f"{r['rounds_lost_to_preemption']} | {r['rounds_lost_to_failures']} | "
                f"{r['longest_wait_h']:.1f} | {r['makespan_h']:.1f} |"
            )
    lines += [
        "",
        "> fifo: submission order, no preemption, the first job that cannot start holds back "
        "its capacity at once (others backfill around it). priority: the scheduler's defaults "
        "(ageing +10 per hour waited, fair share, preemption at the round boundary outside a "
        "1-round snapshot window). priority_reserve: the same, with capacity held back for "
        "the first job waiting over 1 h. "
        "priority_immediate: the same, but victims stopped at once, resuming from their last "
        "snapshot (contrast only).",
        "> Rounds lost to failures depend on the snapshot interval (Young/Daly per job) and "
        "on how long jobs run, so they differ between policies only through scheduling.",
        "> Longest wait: the most time any job (of any priority, over the seeds) waited for "
        "its first start. Ageing bounds the order, not the wait: a gang that needs whole "
        "regions at once waits while smaller jobs keep filling them.",
        "",
    ]
    lines += targets_table(report["targets"])
    return "\n".join(lines) + "\n"


def targets(results: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []
    lost = {k: v["priority"]["rounds_lost_to_preemption"] for k, v in results.items()}
    preempted = {k: v["priority"]["preemptions"] for k, v in results.items()}
    checks.append(
        {
            "name": "no rounds lost to preemption at round boundaries",
            "measured": ", ".join(
                f"{k} regions: {lost[k]} lost in {preempted[k]} preemptions" for k in lost
            ),
            "met": all(v == 0 for v in lost.values()),
        }
    )
    faster = {
        k: (v["priority"]["wait_mean_min"]["production"], v["fifo"]["wait_mean_min"]["production"])
        for k, v in results.items()
    }
    checks.append(
        {
            "name": "production waits less than under FIFO",
            "measured": ", ".join(
                f"{k} regions: {_fmt(a, 1)} vs {_fmt(b, 1)} min" for k, (a, b) in faster.items()
            ),
            "met": all(a is not None and b is not None and a < b for a, b in faster.values()),
        }
    )
    started = {k: v["priority"]["never_started"] for k, v in results.items()}
    checks.append(
        {
            "name": "every job starts before the run ends (its longest wait reported)",
            "measured": ", ".join(
                f"{k} regions: {n} never started, longest wait "
                f"{results[k]['priority']['longest_wait_h']:.1f} h"
                for k, n in started.items()
            ),
            "met": all(n == 0 for n in started.values()),
        }
    )
    return checks


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one value")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--regions", type=_ints, default=[3, 5, 8])
    parser.add_argument("--seeds", type=_ints, default=[0, 1, 2])
    parser.add_argument("--load", type=float, default=0.7)
    parser.add_argument("--arrival-h", type=float, default=72.0)
    parser.add_argument("--mtbf-h", type=float, default=48.0)
    parser.add_argument("--downtime-min", type=float, default=30.0)
    parser.add_argument("--smoke", action="store_true", help="3 regions, 40 jobs, one seed")
    parser.add_argument("--out", type=Path, default=RESULTS / "scheduling.json")
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    if args.smoke:
        args.jobs, args.regions, args.seeds, args.arrival_h = 40, [3], [0], 12.0
    if args.jobs < 1 or any(not 1 <= r <= 64 for r in args.regions):
        parser.error("need --jobs >= 1 and 1..64 regions")
    if not (args.load > 0 and args.arrival_h > 0 and args.mtbf_h > 0 and args.downtime_min >= 0):
        parser.error("--load, --arrival-h and --mtbf-h must be positive")
    began = time.perf_counter()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for regions in args.regions:
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
        for seed in args.seeds:
            workload = draw_workload(
                seed,
                regions,
                args.jobs,
                load=args.load,
                arrival_h=args.arrival_h,
                mtbf_h=args.mtbf_h,
                downtime_min=args.downtime_min,
            )
            for policy in POLICIES:
                runs[policy].append(simulate(workload, policy))
        results[str(regions)] = {p: summarise(r) for p, r in runs.items()}
        print(f"{regions} regions done ({time.perf_counter() - began:.0f} s)", file=sys.stderr)
    report = {
        "benchmark": "scheduling",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "note": args.note,
        "machine": describe_machine(),
        "settings": {
            "jobs": args.jobs,
            "regions": args.regions,
            "seeds": args.seeds,
            "load": args.load,
            "arrival_h": args.arrival_h,
            "mtbf_h": args.mtbf_h,
            "downtime_min": args.downtime_min,
            "step_s": STEP_S,
            "smoke": args.smoke,
            "policies": list(POLICIES),
        },
        "results": results,
        "wall_s": time.perf_counter() - began,
    }
    report["targets"] = targets(results)
    publish(report, args.out, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
