"""Compute utilization of a real federation under an emulated WAN.

    python -m benchmarks.utilization [--sizes s,m] [--big] [--rounds 4] [--inner-steps 30]
        [--bandwidth 1gbit] [--rtt 80ms] [--scale 400]
        [--modes none,delayed,delayed-eager,streaming]
        [--smoke] [--out PATH] [--note TEXT]

A coordinator and two regional agents run as processes (``tests/support/federation.py``:
real HTTPS with client certificates, each agent with its own gloo worker group), and each
region reaches the coordinator through its own emulated WAN link (:mod:`geofed.wanemu`).
The job trains the bundled charlm task at each model size of ``--sizes`` (task options),
once per mode the job spec accepts: the overlap modes, and ``delayed-eager`` (delayed
rounds started from the eager estimate, ``overlap_start: eager``); a mode the spec refuses
is reported as such.

The link defaults to 1 Gbit/s and 80 ms RTT, with the bandwidth divided by ``--scale``
(400): the models a CPU trains are some thousand times smaller than those the link
figures describe, and a round's communication should stay a comparable share of its
compute. The RTT is not scaled. The report states the link actually emulated.

What is measured comes from each agent's round timeline (``round_timeline.jsonl`` in its
state directory, :mod:`regional_agent.rounds.timeline`): per region and round the training
seconds (the workers' inner loop) and the overhead: ``sync`` (download and apply θ),
``load`` (the rest of the worker group's round: handing θ over, loading it, handing the
result back), ``encode`` (encode, sign, spool), ``upload`` and ``wait`` (from the delta's
acceptance to the next round's announcement: quorum, aggregation, outer step,
publication). The last round's ``wait`` runs to the job's end (the final evaluation
included) and is left out of the means. Compute utilization is the union of a region's
training intervals over their span (:func:`regional_agent.handoff.utilization.compute_utilization`).

Figures from a busy machine are slow and noisy; the machine and its load are stated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
import yaml
from prometheus_client.parser import text_string_to_metric_families

from benchmarks._machine import describe_machine, machine_line
from benchmarks._report import publish
from coordinator.jobs.spec import JobSpec
from geofed.examples.charlm.task import CharLMOptions, CharLMTask
from geofed.wanemu import WanProxy
from geofed.wanspec import WanLink, WanSpecError, parse_bandwidth, parse_duration
from regional_agent.handoff.utilization import compute_utilization
from regional_agent.rounds.timeline import RoundTimeline, read_timeline
from tests.support.federation import EXAMPLES, running_federation

REGIONS = ("eu-west", "us-east")
#: Each mode's job fields: the overlap modes, and delayed rounds started from the eager
#: estimate (``overlap_start: eager``).
MODE_FIELDS: dict[str, dict[str, str]] = {
    "none": {"overlap": "none"},
    "delayed": {"overlap": "delayed"},
    "delayed-eager": {"overlap": "delayed", "overlap_start": "eager"},
    "streaming": {"overlap": "streaming"},
}
MODES = tuple(MODE_FIELDS)
OVERHEAD = ("sync", "load", "encode", "upload", "wait")
_SMALL = {"seq_len": 64, "batch_size": 8, "val_batches": 2}
#: Model sizes (charlm task options); parameters: xs 30k, s 0.28M, m 0.87M, l 3.3M, xl 25.5M.
SIZES: dict[str, dict[str, Any]] = {
    "xs": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32, "batch_size": 8,
           "val_batches": 2},
    "s": {"d_model": 96, "n_layers": 2, "n_heads": 4, **_SMALL},
    "m": {"d_model": 128, "n_layers": 4, "n_heads": 4, **_SMALL},
    "l": {"d_model": 256, "n_layers": 4, "n_heads": 4, **_SMALL},
    "xl": {"d_model": 512, "n_layers": 8, "n_heads": 8, **_SMALL},
}  # fmt: skip
DEFAULT_SIZES = ("s", "m")
BIG_SIZES = ("l", "xl")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "utilization.json"


@dataclass(frozen=True)
class Settings:
    sizes: tuple[str, ...]
    modes: tuple[str, ...] | None
    rounds: int
    inner_steps: int
    reference: WanLink
    scale: float
    timeout_s: float
    smoke: bool
    out: Path
    note: str

    @property
    def link(self) -> WanLink:
        return self.reference.scaled(self.scale)


def parameters(options: dict[str, Any]) -> int:
    model = CharLMTask(CharLMOptions(**options)).build_model()
    return sum(p.numel() for p in model.parameters())


def overlap_modes(requested: Sequence[str] | None) -> dict[str, dict[str, Any]]:
    """Each overlap mode and whether the job spec accepts it (the reason when not).

    Asked by validating the example job with the mode's fields (:data:`MODE_FIELDS`) set.
    A spec without the field trains serially: ``none`` then runs with the field left out.
    """
    base = yaml.safe_load((EXAMPLES / "job-charlm.yaml").read_text())
    found: dict[str, dict[str, Any]] = {}
    for mode in requested or MODES:
        try:
            JobSpec.model_validate({**base, **MODE_FIELDS[mode]})
        except pydantic.ValidationError as exc:
            reason = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                for e in exc.errors()
                if e["loc"] and e["loc"][0] in MODE_FIELDS[mode]
            )
            if mode == "none" and "Extra inputs" in reason:
                serial = "the job spec has no overlap field: serial rounds"
                found[mode] = {"available": True, "set_field": False, "detail": serial}
            else:
                found[mode] = {"available": False, "detail": f"not available: {reason or exc}"}
            continue
        found[mode] = {"available": True, "set_field": True, "detail": "accepted by the job spec"}
    return found


def _customize(
    proxies: dict[str, WanProxy], fields: dict[str, str]
) -> Callable[[str, dict[str, Any]], None]:
    def customize(name: str, data: dict[str, Any]) -> None:
        if name == "coordinator":
            for proxy in proxies.values():
                proxy.target_port = int(data["listen"]["port"])
        elif name.startswith("agent-"):
            region = name.removeprefix("agent-")
            data["coordinator_url"] = f"https://localhost:{proxies[region].port}"
        elif name == "job":
            data.update(fields)

    return customize


async def run_federation(
    work: Path, settings: Settings, options: dict[str, Any], fields: dict[str, str]
) -> tuple[
    dict[str, list[RoundTimeline]], dict[str, dict[str, int]], float, dict[str, float | None]
]:
    """One federation to the end of its job: each region's timeline, WAN bytes, wall time,
    and the coordinator's figures (:func:`coordinator_figures`)."""
    link = settings.link.settings()
    proxies = {
        region: WanProxy("127.0.0.1", 0, "127.0.0.1", 0, seed=i, upstream=link, downstream=link)
        for i, region in enumerate(REGIONS)
    }
    for proxy in proxies.values():
        await proxy.start()
    started = time.monotonic()
    try:
        async with running_federation(
            work,
            regions=REGIONS,
            rounds=settings.rounds,
            inner_steps=settings.inner_steps,
            task_options=options,
            customize=_customize(proxies, fields),
            # As production starts them (new interpreters), so that its figures hold there.
            fork=False,
        ) as fed:
            status, body = await fed.submit()
            if status != 201:
                raise RuntimeError(f"job refused ({status}): {body}")
            await fed.wait_completed(timeout_s=settings.timeout_s)
            wall = time.monotonic() - started
            coordinator = coordinator_figures(await fed.metrics_text(), fed.job)
        wan = {
            region: {
                "bytes_up": proxy.stats().bytes_upstream,
                "bytes_down": proxy.stats().bytes_downstream,
            }
            for region, proxy in proxies.items()
        }
    finally:
        for proxy in proxies.values():
            await proxy.stop()
    # Read after the agents stopped: each writes its last rounds on the way out.
    timelines = {
        region: [r for r in read_timeline(work / "agents" / region) if r.job == fed.job]
        for region in REGIONS
    }
    return timelines, wan, wall, coordinator


def coordinator_figures(metrics: str, job: str) -> dict[str, float | None]:
    """The coordinator's mean seconds per published round of ``job``, from its /metrics:
    aggregation, outer step, encoding and persistence (``aggregate_s``), and announcement
    to publication (``round_s``); None where it published no round."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.labels.get("job") == job and sample.name.endswith(("_sum", "_count")):
                found[sample.name] = sample.value

    def mean(name: str) -> float | None:
        count = found.get(f"{name}_count")
        return found[f"{name}_sum"] / count if count else None

    return {
        "aggregate_s": mean("geofed_aggregation_duration_seconds"),
        "round_s": mean("geofed_round_duration_seconds"),
    }


def round_row(entry: RoundTimeline) -> dict[str, Any]:
    train = entry.worker.seconds if entry.worker is not None else None
    row: dict[str, Any] = {"round": entry.round, "train_s": train}
    for phase in ("sync", "encode", "upload", "wait"):
        row[f"{phase}_s"] = entry.seconds(phase) if phase in entry.phases else None
    if train is not None and "train" in entry.phases:
        row["load_s"] = max(0.0, entry.seconds("train") - train)
    else:
        row["load_s"] = None
    starts = [i.start for i in entry.phases.values()]
    ends = [i.end for i in entry.phases.values()]
    row["round_s"] = max(ends) - min(starts) if starts else None
    return row


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [row[key] for row in rows if row[key] is not None]
    return statistics.fmean(values) if values else None


def region_figures(rounds: list[RoundTimeline], wan: dict[str, int]) -> dict[str, Any]:
    rows = [round_row(entry) for entry in sorted(rounds, key=lambda r: r.round)]
    used = compute_utilization(
        [(r.worker.start, r.worker.end) for r in rounds if r.worker is not None]
    )
    # The last round's wait runs to the job's end (final evaluation): not a round's wait.
    waits = rows[:-1] if len(rows) > 1 else []
    means = {f"{k}_s": _mean(rows, f"{k}_s") for k in ("train", *OVERHEAD) if k != "wait"}
    means["wait_s"] = _mean(waits, "wait_s")
    return {
        "compute_utilization": used.fraction,
        "busy_s": used.busy_s,
        "span_s": used.span_s,
        "rounds_recorded": len(rows),
        "mean_per_round": means,
        "rounds": rows,
        "wan": wan,
    }


async def measure(settings: Settings) -> dict[str, Any]:
    modes = overlap_modes(settings.modes)
    report_modes: dict[str, Any] = {}
    for mode, verdict in modes.items():
        entry: dict[str, Any] = {**verdict, "runs": {}}
        report_modes[mode] = entry
        if not verdict["available"]:
            print(f"overlap {mode}: {verdict['detail']}", file=sys.stderr)
            continue
        for size in settings.sizes:
            options = SIZES[size]
            print(f"overlap {mode}, size {size}: running ...", file=sys.stderr)
            with tempfile.TemporaryDirectory(prefix="geofed-util-") as tmp:
                fields = MODE_FIELDS[mode] if verdict["set_field"] else {}
                try:
                    timelines, wan, wall, coordinator = await run_federation(
                        Path(tmp), settings, options, fields
                    )
                except (AssertionError, RuntimeError, OSError) as exc:
                    # Reported, not hidden: a mode that cannot finish a job says so.
                    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    print(f"overlap {mode}, size {size}: failed: {exc}", file=sys.stderr)
                    entry["runs"][size] = {"error": first[:300]}
                    continue
            entry["runs"][size] = {
                "task_options": options,
                "parameters": parameters(options),
                "wall_s": wall,
                "regions": {r: region_figures(timelines[r], wan[r]) for r in REGIONS},
                "coordinator": coordinator,
            }
    link = settings.link
    return {
        "benchmark": "utilization",
        "machine": describe_machine(),
        "settings": {
            "regions": list(REGIONS),
            "workers_per_region": 2,
            "rounds": settings.rounds,
            "inner_steps": settings.inner_steps,
            "sizes": list(settings.sizes),
            "smoke": settings.smoke,
            "note": settings.note,
            "link": {
                "reference": settings.reference.describe(),
                "scale": settings.scale,
                "emulated": link.describe(),
                "bandwidth_bits_per_s": link.bandwidth_bits_per_s,
                "rtt_s": link.rtt_s,
                "scaling": f"bandwidth of {settings.reference.describe()} divided by "
                f"{settings.scale:g}, RTT unchanged, each region's link to the coordinator, "
                "each direction",
            },
        },
        "modes": report_modes,
    }


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(report: dict[str, Any]) -> str:
    settings = report["settings"]
    link = settings["link"]
    lines = [
        "# Compute utilization under an emulated WAN",
        "",
        f"Machine: {machine_line(report['machine'])}.",
        "",
        f"{len(settings['regions'])} regions ({', '.join(settings['regions'])}), "
        f"{settings['workers_per_region']} gloo workers each, {settings['rounds']} rounds of "
        f"H = {settings['inner_steps']} inner steps. WAN per region link: {link['emulated']} "
        f"({link['scaling']}).",
        "",
        "Utilization = union of the workers' training intervals / their span. Seconds are "
        "means per round; `wait` leaves out the last round (it runs to the job's end).",
    ]
    if settings["smoke"]:
        lines += ["", "**Smoke run**: proves the benchmark works; the figures mean little."]
    if settings["note"]:
        lines += ["", f"Note: {settings['note']}"]
    for mode, entry in report["modes"].items():
        lines += ["", f"## overlap: {mode}", "", entry["detail"] + "."]
        if not entry["runs"]:
            continue
        lines += [
            "",
            "| size | params | region | utilization | train s | sync s | load s | encode s "
            "| upload s | wait s | WAN up MB | WAN down MB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for size, run in entry["runs"].items():
            if "error" in run:
                lines.append(f"| {size} | - | failed: {run['error']} |" + " |" * 9)
                continue
            for region, fig in run["regions"].items():
                mean = fig["mean_per_round"]
                util = fig["compute_utilization"]
                lines.append(
                    f"| {size} | {run['parameters'] / 1e6:.2f}M | {region} "
                    f"| {'-' if util is None else f'{util:.1%}'} | {_fmt(mean['train_s'])} "
                    + " ".join(f"| {_fmt(mean[f'{k}_s'])}" for k in OVERHEAD)
                    + f" | {fig['wan']['bytes_up'] / 1e6:.2f}"
                    + f" | {fig['wan']['bytes_down'] / 1e6:.2f} |"
                )
        coordinator = {
            size: run["coordinator"] for size, run in entry["runs"].items() if "coordinator" in run
        }
        if coordinator:
            lines += [
                "",
                "Inside `wait`, the coordinator's share per published round (its /metrics): "
                "aggregation, outer step, encoding and persistence; and a round from its "
                "announcement to its publication.",
                "",
                "| size | aggregate + publish s | announcement to publication s |",
                "|---|---|---|",
            ]
            lines += [
                f"| {size} | {_fmt(fig['aggregate_s'])} | {_fmt(fig['round_s'])} |"
                for size, fig in coordinator.items()
            ]
    return "\n".join(lines) + "\n"


def _sizes(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in SIZES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"sizes must be a comma list of {', '.join(SIZES)}; got {text!r}"
        )
    return names


def _modes(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or any(n not in MODES for n in names):
        raise argparse.ArgumentTypeError(f"modes must be a comma list of {', '.join(MODES)}")
    return names


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _unit(parse: Callable[[str], float]) -> Callable[[str], float]:
    def read(text: str) -> float:
        try:
            return parse(text)
        except WanSpecError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return read


def _scale(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"scale must be > 0, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.utilization", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--sizes", type=_sizes, help=f"of {', '.join(SIZES)}; default s,m")
    parser.add_argument("--big", action="store_true", help="add the sizes l (3.3M), xl (25.5M)")
    parser.add_argument("--modes", type=_modes, help="overlap modes; default every one")
    parser.add_argument("--rounds", type=_positive, help="default 4; smoke 2")
    parser.add_argument("--inner-steps", type=_positive, help="default 30; smoke 5")
    parser.add_argument("--bandwidth", type=_unit(parse_bandwidth), help="default 1gbit")
    parser.add_argument("--rtt", type=_unit(parse_duration), help="default 80ms")
    parser.add_argument("--scale", type=_scale, help="bandwidth divisor; default 400, smoke 50")
    parser.add_argument("--timeout", type=float, default=900.0, help="per run, seconds")
    parser.add_argument("--smoke", action="store_true", help="one tiny size, 2 rounds")
    parser.add_argument("--out", type=Path, help="JSON path; the markdown goes next to it")
    parser.add_argument("--note", default="", help="free text stored with the figures")
    return parser


def settings_from(argv: Sequence[str] | None) -> Settings:
    args = _parser().parse_args(argv)
    sizes = args.sizes or (("xs",) if args.smoke else DEFAULT_SIZES)
    if args.big:
        sizes = tuple(dict.fromkeys((*sizes, *BIG_SIZES)))
    return Settings(
        sizes=sizes,
        modes=args.modes,
        rounds=args.rounds or (2 if args.smoke else 4),
        inner_steps=args.inner_steps or (5 if args.smoke else 30),
        reference=WanLink(
            args.bandwidth if args.bandwidth is not None else 1e9,
            args.rtt if args.rtt is not None else 0.08,
        ),
        scale=args.scale or (50.0 if args.smoke else 400.0),
        timeout_s=args.timeout,
        smoke=args.smoke,
        out=args.out or DEFAULT_OUT,
        note=args.note,
    )


def main(argv: Sequence[str] | None = None) -> int:
    settings = settings_from(argv)
    print(f"machine: {machine_line(describe_machine())}", file=sys.stderr)
    print(f"WAN per region link: {settings.link.describe()}", file=sys.stderr)
    report = asyncio.run(measure(settings))
    publish(report, settings.out, render(report))
    print(json.dumps({"out": str(settings.out)}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
