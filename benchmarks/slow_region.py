"""A region twice as slow as the other: what each way of handling it costs and keeps.

    python -m benchmarks.slow_region [--rounds 12] [--inner-steps 120] [--size s]
        [--slowdown 2] [--modes wait-all,drop,merge] [--deadline S] [--out PATH] [--note T]

A coordinator and two regional agents run as processes (``tests/support/federation.py``:
real HTTPS with client certificates, one gloo rank per region) and train the bundled
charlm task. us-east's worker group is throttled: its rank is stopped (SIGSTOP) for
``1 - 1/slowdown`` of every 50 ms and continued for the rest, so it computes ``slowdown``
times slower; the report states the slowdown measured (its training seconds per round
against eu-west's). Each mode runs the same job but for how a round treats us-east:

* ``wait-all``: ``min_regions: 2``, every round waits for both (synchronous training);
* ``drop``: ``min_regions: 1``, a round closes at its deadline, and a delta that misses
  it is refused (``aggregation.late: drop``; repeated misses quarantine the region);
* ``merge``: ``min_regions: 1``, the same deadline, and a delta that misses it is merged
  into the next round at weight tokens / (1 + staleness) (``aggregation.late: merge``);
  a round closes a grace window after its quorum, sized from the arrivals.

The deadline of ``drop`` and ``merge`` is fixed: 1.25 x eu-west's mean round time in the
``wait-all`` run (its sync, load, training, encode and upload), or ``--deadline``. eu-west
evaluates every θ before training from it (``evaluation: region:eu-west``), the job's
last θ is evaluated by the coordinator. Per mode the report gives the wall time, each
region's rounds trained and how many of them reached θ (fresh or merged), and the
validation loss at the end, at the wall time the fastest mode took, and at the tokens the
mode with the fewest put into θ. One seed per mode: a single run's loss is noisy, the
shares and wall times less so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks._machine import describe_machine, machine_line
from benchmarks._report import publish
from benchmarks.utilization import SIZES, parameters
from coordinator.state.audit import AuditEntry
from regional_agent.rounds.timeline import RoundTimeline, read_timeline
from tests.support.observe import audit_entries, observed_federation, signal_all, worker_ranks

REGIONS = ("eu-west", "us-east")
FAST, SLOW = REGIONS
MODES = ("wait-all", "drop", "merge")
#: Phases of a round from its start to its delta's acceptance, as the timeline names them.
_TO_DELIVERY = ("sync", "load", "train", "encode", "upload")
_PERIOD_S = 0.05
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "slow_region.json"


@dataclass(frozen=True)
class Settings:
    rounds: int
    inner_steps: int
    size: str
    slowdown: float
    modes: tuple[str, ...]
    deadline_s: float | None
    timeout_s: float
    out: Path
    note: str


@dataclass(frozen=True)
class Point:
    """θ_version: when it was published (seconds after the job's submission), the tokens
    summed into it so far, and its validation loss if it was evaluated."""

    version: int
    at_s: float
    tokens: int
    loss: float | None


def mode_fields(mode: str, deadline_s: float | None) -> dict[str, Any]:
    """The job spec fields of ``mode``; ``deadline_s`` is the fixed deadline of the modes
    that close without the slow region."""
    if mode == "wait-all":
        return {"min_regions": 2, "deadline": {"initial_s": 600, "min_s": 60, "max_s": 600}}
    if deadline_s is None:
        raise ValueError(f"mode {mode} needs a deadline (run wait-all first, or --deadline)")
    fixed = {"initial_s": deadline_s, "min_s": deadline_s, "max_s": deadline_s}
    late = "merge" if mode == "merge" else "drop"
    return {"min_regions": 1, "deadline": fixed, "aggregation": {"late": late}}


def _seconds(time_text: str) -> float:
    return datetime.fromisoformat(time_text).timestamp()


def loss_curve(
    entries: Iterable[AuditEntry], losses: Mapping[int, float], submitted_at: float
) -> list[Point]:
    """θ_0, θ_1, ... as the job's ``round.publish`` audit entries and its validation
    losses (version -> loss) give them."""
    points = [Point(0, 0.0, 0, losses.get(0))]
    tokens = 0
    published = sorted(
        (e for e in entries if e.action == "round.publish" and e.round is not None),
        key=lambda e: e.round or 0,
    )
    for entry in published:
        assert entry.round is not None
        tokens += int(entry.details.get("tokens", 0))
        version = entry.round + 1
        at = _seconds(entry.time) - submitted_at
        points.append(Point(version, at, tokens, losses.get(version)))
    return points


def loss_at_time(curve: Sequence[Point], at_s: float) -> float | None:
    """The loss of the newest evaluated θ published by ``at_s``."""
    found = [p.loss for p in curve if p.at_s <= at_s and p.loss is not None]
    return found[-1] if found else None


def loss_at_tokens(curve: Sequence[Point], tokens: int) -> float | None:
    """The loss of the first evaluated θ holding at least ``tokens`` tokens."""
    found = [p.loss for p in curve if p.tokens >= tokens and p.loss is not None]
    return found[0] if found else None


def rounds_in_theta(entries: Iterable[AuditEntry]) -> dict[str, int]:
    """How many of each region's deltas a publication summed, fresh or merged late."""
    counts = dict.fromkeys(REGIONS, 0)
    for entry in entries:
        if entry.action != "round.publish":
            continue
        for key in entry.details.get("order", []):
            region = str(key).partition("@")[0]
            counts[region] = counts.get(region, 0) + 1
    return counts


def region_figures(
    timelines: Mapping[str, Sequence[RoundTimeline]], in_theta: Mapping[str, int]
) -> dict[str, dict[str, Any]]:
    """Per region: rounds trained (its timeline's rounds with training), those in θ, the
    share, and the mean seconds of its training and of its rounds to delivery."""
    figures = {}
    for region in REGIONS:
        trained = [t for t in timelines.get(region, ()) if t.seconds("train") > 0]
        count = len(trained)
        figures[region] = {
            "rounds_trained": count,
            "rounds_in_theta": in_theta.get(region, 0),
            "share_in_theta": in_theta.get(region, 0) / count if count else None,
            "train_s": statistics.fmean(t.seconds("train") for t in trained) if trained else None,
            "round_s": statistics.fmean(sum(t.seconds(p) for p in _TO_DELIVERY) for t in trained)
            if trained
            else None,
        }
    return figures


def compare(modes: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """Each run's loss at the wall time the fastest took and at the fewest tokens in θ."""
    runs = {m: r for m, r in modes.items() if "curve" in r}
    if not runs:
        return {}
    at_s = min(r["curve"][-1]["at_s"] for r in runs.values())
    tokens = min(r["curve"][-1]["tokens"] for r in runs.values())
    result: dict[str, Any] = {"at_s": at_s, "tokens": tokens, "loss": {}}
    for mode, run in runs.items():
        curve = [Point(**p) for p in run["curve"]]
        result["loss"][mode] = {
            "at_equal_time": loss_at_time(curve, at_s),
            "at_equal_tokens": loss_at_tokens(curve, tokens),
            "final": curve[-1].loss,
        }
    return result


async def _throttle(fed: Any, region: str, slowdown: float) -> None:
    """Stop ``region``'s ranks for 1 - 1/slowdown of every period, until cancelled."""
    stopped = _PERIOD_S * (1 - 1 / slowdown)
    pids: list[int] = []
    refreshed = 0.0
    try:
        while True:
            if time.monotonic() - refreshed > 1.0:
                with contextlib.suppress(OSError, ValueError, AssertionError):
                    pids = worker_ranks(fed, region)
                refreshed = time.monotonic()
            signal_all(pids, signal.SIGSTOP)
            await asyncio.sleep(stopped)
            signal_all(pids, signal.SIGCONT)
            await asyncio.sleep(_PERIOD_S - stopped)
    finally:
        signal_all(pids, signal.SIGCONT)


def _customize(fields: Mapping[str, Any]) -> Any:
    def customize(name: str, data: dict[str, Any]) -> None:
        if name == "coordinator":
            # A deadline must outlast one upload: the fixed deadlines are seconds long.
            data["timeouts"] = {
                "connect_s": 2,
                "heartbeat_s": 2,
                "request_s": 3,
                "upload_s": 4,
                "download_s": 20,
                "round_deadline_s": 600,
            }
        elif name == "job":
            data["evaluation"] = {"where": f"region:{FAST}", "every": 1}
            data.update(fields)

    return customize


async def run_mode(work: Path, settings: Settings, fields: Mapping[str, Any]) -> dict[str, Any]:
    """One federation to its job's end with the slow region throttled; its figures."""
    async with observed_federation(
        work,
        regions=REGIONS,
        rounds=settings.rounds,
        inner_steps=settings.inner_steps,
        task_options=SIZES[settings.size],
        customize=_customize(fields),
        submit=False,
    ) as (fed, _observer):
        throttle = asyncio.create_task(_throttle(fed, SLOW, settings.slowdown))
        try:
            submitted = time.time()
            status, body = await fed.submit()
            if status != 201:
                raise RuntimeError(f"job refused ({status}): {body}")
            job = await fed.wait_completed(timeout_s=settings.timeout_s)
            wall = time.time() - submitted
            entries = await audit_entries(fed, job=fed.job)
        finally:
            throttle.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await throttle
    timelines = {
        r: [t for t in read_timeline(work / "agents" / r) if t.job == fed.job] for r in REGIONS
    }
    losses = {int(p["round"]): float(p["value"]) for p in job.get("val_loss_history", [])}
    curve = loss_curve(entries, losses, submitted)
    return {
        "fields": dict(fields),
        "wall_s": wall,
        "regions": region_figures(timelines, rounds_in_theta(entries)),
        "curve": [p.__dict__ for p in curve],
    }


async def measure(settings: Settings) -> dict[str, Any]:
    deadline = settings.deadline_s
    modes: dict[str, Any] = {}
    for mode in settings.modes:
        fields = mode_fields(mode, deadline)
        print(f"{mode}: running ({fields}) ...", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix="geofed-slow-") as tmp:
            run = await run_mode(Path(tmp), settings, fields)
        modes[mode] = run
        if mode == "wait-all" and deadline is None:
            fast = run["regions"][FAST]["round_s"]
            deadline = round(max(5.0, 1.25 * fast), 2)
            print(f"fixed deadline of drop and merge: {deadline} s", file=sys.stderr)
    slowdown = None
    if "wait-all" in modes:
        regions = modes["wait-all"]["regions"]
        if regions[FAST]["train_s"] and regions[SLOW]["train_s"]:
            slowdown = regions[SLOW]["train_s"] / regions[FAST]["train_s"]
    return {
        "benchmark": "slow_region",
        "machine": describe_machine(),
        "settings": {
            "regions": list(REGIONS),
            "slow": SLOW,
            "slowdown_asked": settings.slowdown,
            "slowdown_measured": slowdown,
            "rounds": settings.rounds,
            "inner_steps": settings.inner_steps,
            "size": settings.size,
            "parameters": parameters(SIZES[settings.size]),
            "deadline_s": deadline,
            "note": settings.note,
        },
        "modes": modes,
        "comparison": compare(modes),
    }


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        "# A region twice as slow: wait for it, drop its late deltas, or merge them",
        "",
        f"Machine: {machine_line(report['machine'])}.",
        "",
        f"2 regions, one gloo rank each, charlm size {s['size']} ({s['parameters']:,} "
        f"parameters), {s['rounds']} rounds of H = {s['inner_steps']} inner steps. {s['slow']} "
        f"throttled to 1/{s['slowdown_asked']:g} of its compute (measured: its training "
        f"{_fmt(s['slowdown_measured'], 2)}x as long per round as eu-west's under wait-all). "
        f"drop and merge close a round at a fixed deadline of {_fmt(s['deadline_s'], 2)} s "
        "(merge: or a grace window after its quorum). One run per mode.",
        "",
        "| mode | wall s | region | rounds trained | in θ | share in θ | train s/round |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, run in report["modes"].items():
        for region, r in run["regions"].items():
            share = "-" if r["share_in_theta"] is None else f"{100 * r['share_in_theta']:.0f}%"
            lines.append(
                f"| {mode} | {run['wall_s']:.1f} | {region} | {r['rounds_trained']} | "
                f"{r['rounds_in_theta']} | {share} | {_fmt(r['train_s'], 2)} |"
            )
    comparison = report["comparison"]
    if comparison:
        lines += [
            "",
            f"Validation loss (eu-west's evaluation of each θ; the last θ the coordinator's) "
            f"at the end, at {comparison['at_s']:.1f} s after submission (the fastest mode's "
            f"last publication) and at {comparison['tokens']:,} tokens in θ (the fewest any "
            "mode reached):",
            "",
            "| mode | final | at equal wall time | at equal tokens |",
            "|---|---|---|---|",
        ]
        for mode, loss in comparison["loss"].items():
            lines.append(
                f"| {mode} | {_fmt(loss['final'])} | {_fmt(loss['at_equal_time'])} | "
                f"{_fmt(loss['at_equal_tokens'])} |"
            )
    if s["note"]:
        lines += ["", s["note"]]
    return "\n".join(lines) + "\n"


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = sorted(set(modes) - set(MODES))
    if not modes or unknown:
        raise argparse.ArgumentTypeError(f"modes are {', '.join(MODES)}; got {text!r}")
    return modes


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _slowdown(text: str) -> float:
    value = float(text)
    if not 1 < value <= 10:
        raise argparse.ArgumentTypeError(f"slowdown must be in (1, 10], got {text}")
    return value


def settings_from(argv: Sequence[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.slow_region", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=_positive, default=12)
    parser.add_argument("--inner-steps", type=_positive, default=120)
    parser.add_argument("--size", choices=sorted(SIZES), default="s")
    parser.add_argument("--slowdown", type=_slowdown, default=2.0)
    parser.add_argument("--modes", type=_modes, default=MODES)
    parser.add_argument("--deadline", type=float, help="drop and merge; default from wait-all")
    parser.add_argument("--timeout", type=float, default=900.0, help="per run, seconds")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    if args.deadline is None and args.modes[0] != "wait-all":
        parser.error("drop and merge need --deadline unless wait-all runs first")
    return Settings(
        rounds=args.rounds,
        inner_steps=args.inner_steps,
        size=args.size,
        slowdown=args.slowdown,
        modes=args.modes,
        deadline_s=args.deadline,
        timeout_s=args.timeout,
        out=args.out,
        note=args.note,
    )


def main(argv: Sequence[str] | None = None) -> int:
    settings = settings_from(argv)
    print(f"machine: {machine_line(describe_machine())}", file=sys.stderr)
    report = asyncio.run(measure(settings))
    publish(report, settings.out, render(report))
    print(json.dumps({"out": str(settings.out)}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
