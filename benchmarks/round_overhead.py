"""Coordinator round overhead: time and peak memory from the last accepted delta to the update.

    python -m benchmarks.round_overhead [--regions 2,4,8,16] [--params 25e6] [--scheme int8]
        [--repeats 3] [--threads 1] [--smoke] [--out PATH] [--note TEXT]

For each number of regions R, the coordinator's work once the last delta is accepted is
timed phase by phase, by calling the functions the daemon's ``publish_round`` calls.
Three ways to aggregate are measured: ``folded`` (the daemon's default: each delta is
decoded again from its stored stream into the running sum once its upload's verification
accepted it, all but the last already summed when quorum is reached, so only the last
fold and the division remain), ``streaming`` (decode the R
spooled deltas chunk by chunk into the weighted sum,
:func:`coordinator.aggregation.outer_round.mean_delta`, as a restarted coordinator or a norm-checked
job does) and ``naive`` (below); then the steps of
:func:`coordinator.aggregation.outer_round.publication_step` (the outer step, encoding the update
with
coordinator-side error feedback, decoding it, θ_{r+1} = θ_r + û), and storing the round
(:func:`coordinator.aggregation.outer_round.store_round`: θ_{r+1}'s hash, its working state, the
signed
update and, as on a round that is due one, a snapshot, to a local disk; the same writes
one after another are timed too, outside the round, as that phase's baseline). The
baseline ("naive"), run the same way, replaces only the first phase: it
decodes every delta fully into memory and averages with ``torch.stack(...).mean(0)``,
which the daemon never does.

The model is the charlm transformer's tensor layout (d_model 512 and as many layers as
``--params`` needs: 25.5M parameters for 25e6) filled with synthetic random values.
Deltas are encoded before anything is timed and spooled to a blob store like the
coordinator's (:class:`geofed.blobstore.FsBlobStore`), which is read in 1 MiB parts and
verified against each blob's digest. Each (R, method) runs in a fresh process;
its peak memory is the peak RSS above the RSS at the start of the round (which holds θ,
the outer momentum and the update residual), per phase (see :mod:`benchmarks._memory`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from benchmarks._machine import describe_machine, machine_line, targets_table
from benchmarks._memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss
from benchmarks._report import publish
from coordinator.aggregation.outer_optimizer import OuterOptimizer, OuterOptimizerConfig
from coordinator.aggregation.outer_round import (
    PUBLICATION_PHASES,
    DeltaSource,
    JobPublishing,
    mean_delta,
    publication_step,
    publish_initial,
    store_round,
    stored_delta,
)
from coordinator.aggregation.weighted import WeightedSum
from coordinator.storage.working_state import WorkingState
from geofed.blobstore import BlobStore, FsBlobStore
from geofed.codec import decode, encode_stream
from geofed.codec_params import SCHEMES, CodecParams, Scheme
from geofed.examples.charlm.model import CharTransformer
from geofed.params import federated_state, parameters_vector_hash
from tests.support.publishing import job_publishing

RESULTS = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent
METHODS = ("streaming", "folded", "naive")
PHASES = ("aggregate", *PUBLICATION_PHASES, "store")
REGION_TOKENS = 65536  # every region reports the same tokens: the naive mean is then exact
# glibc's initial mmap threshold, fixed: every block of 128 KiB or more is its own mapping
# and goes back to the OS when freed, so RSS follows the live tensors. (glibc otherwise
# raises the threshold as blocks are freed and keeps freed blocks in its heap, and the
# RSS figure would depend on allocation history more than on the algorithm.)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
CHILD_FLAG = "--measure-child"
_NOW = datetime(2026, 1, 1, tzinfo=UTC)

Shapes = dict[str, tuple[int, ...]]


# -- the model ---------------------------------------------------------------------


def charlm_config(params: int) -> dict[str, int]:
    """Return the smallest charlm configuration of at least ``params`` parameters.

    Width 512 (as the task documents for ~25M parameters) from 10M parameters up,
    narrower below, so that a smoke run stays small; depth is what makes up the count.
    """
    d_model = 512 if params >= 10_000_000 else 256 if params >= 2_000_000 else 128
    config = {"d_model": d_model, "n_heads": 8, "d_ff": 4 * d_model, "max_len": 64}
    one = _count(charlm_shapes({**config, "n_layers": 1}))
    per_layer = _count(charlm_shapes({**config, "n_layers": 2})) - one
    return {**config, "n_layers": max(1, math.ceil((params - (one - per_layer)) / per_layer))}


def charlm_shapes(config: dict[str, int]) -> Shapes:
    """Return the state's tensor shapes without allocating it (on the meta device)."""
    with torch.device("meta"):
        model = CharTransformer(dropout=0.0, **config)
    return {name: tuple(t.shape) for name, t in federated_state(model).items()}


def _count(shapes: Shapes) -> int:
    return sum(math.prod(shape) for shape in shapes.values())


def random_state(shapes: Shapes, seed: int, scale: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) * scale for name, shape in shapes.items()}


def write_spool(shapes: Shapes, scheme: Scheme, regions: int, blobs: BlobStore) -> list[str]:
    """Encode one delta per region (Δ ~ N(0, 1e-3²)) into ``blobs``; return their digests."""
    return [
        blobs.put_stream(
            encode_stream(random_state(shapes, 1000 + index, 1e-3), CodecParams(scheme)).frames()
        )
        for index in range(regions)
    ]


def delta_sources(digests: Sequence[str]) -> list[DeltaSource]:
    return [
        DeltaSource(f"region-{index:02d}", REGION_TOKENS, digest)
        for index, digest in enumerate(digests)
    ]


# -- one measured process ----------------------------------------------------------


def streaming_mean(
    shapes: Shapes, blobs: BlobStore, sources: Sequence[DeltaSource]
) -> dict[str, torch.Tensor]:
    """The daemon's aggregation: chunk by chunk into the weighted sum, in canonical order."""
    # The bound the coordinator puts on a delta's decoded size: the model's fp32 size.
    return mean_delta(blobs, shapes, sources, 4 * _count(shapes)).delta


def naive_mean(
    shapes: Shapes, blobs: BlobStore, sources: Sequence[DeltaSource]
) -> dict[str, torch.Tensor]:
    """Baseline, not the daemon's path: decode every delta whole, then stack and average."""
    deltas = []
    for source in sources:
        with blobs.open(source.blob_digest) as reader:
            deltas.append(decode(reader))
    return {name: torch.stack([delta[name] for delta in deltas]).mean(0) for name in shapes}


def publishing(root: Path, shapes: Shapes, codec: CodecParams, job: str) -> JobPublishing:
    """A job's checkpoint location and working-state store on the local disk, signing with
    a coordinator certificate of a throw-away CA (made with the test suite's PKI helper).
    Every round also writes a snapshot: the worst case."""
    return job_publishing(root, shapes, codec, job=job, snapshot_every=1)


@dataclass
class Prefolded:
    """A round just before quorum, as the daemon holds it when deltas fold on arrival:
    every delta but the last summed, the last one verified and stored."""

    total: WeightedSum
    blobs: FsBlobStore
    last: DeltaSource
    limit: int


def prefold(shapes: Shapes, blobs: FsBlobStore, sources: Sequence[DeltaSource]) -> Prefolded:
    """Fold all deltas but the last (untimed: that work happens while the deltas arrive,
    before quorum), each decoded from its stored stream as the daemon folds it."""
    if not sources:
        raise ValueError("no delta to fold")
    total = WeightedSum(shapes)
    limit = 4 * _count(shapes)
    for source in sources[:-1]:
        total.add_verified(
            source.region, float(REGION_TOKENS), stored_delta(blobs, source.blob_digest, limit)
        )
    return Prefolded(total, blobs, sources[-1], limit)


def folded_mean(prepared: Prefolded) -> dict[str, torch.Tensor]:
    """What remains at quorum: the last delta's fold (decoded from its stored stream),
    and the division."""
    last = prepared.last
    feed = stored_delta(prepared.blobs, last.blob_digest, prepared.limit)
    prepared.total.add_verified(last.region, float(REGION_TOKENS), feed)
    return prepared.total.take_mean()


@dataclass
class _Meter:
    """Seconds and peak RSS growth (over the round's starting RSS) of each phase."""

    exact: bool = True
    round_start: int = 0

    def __post_init__(self) -> None:
        self.seconds: dict[str, list[float]] = {phase: [] for phase in PHASES}
        self.growth: dict[str, int] = dict.fromkeys(PHASES, 0)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.exact = reset_peak_rss() and self.exact
        started = time.perf_counter()
        yield
        self.seconds[name].append(time.perf_counter() - started)
        peak = peak_rss_bytes() or 0
        self.growth[name] = max(self.growth[name], peak - self.round_start)


def measure(
    method: str,
    shapes: Shapes,
    blobs: FsBlobStore,
    sources: Sequence[DeltaSource],
    scheme: Scheme,
    repeats: int,
    store_root: Path,
) -> dict[str, Any]:
    """Run ``repeats`` coordinator rounds over the spooled deltas; return times and memory.

    The rounds' artifacts and working states are written under ``store_root``.
    """
    mean_of = streaming_mean if method == "streaming" else naive_mean
    theta = random_state(shapes, 1, 0.02)
    # The working state after some round: momentum from one outer step, a residual.
    outer = OuterOptimizer(OuterOptimizerConfig())
    outer.step(theta, random_state(shapes, 2, 1e-3))
    optimizer_state = outer.state_dict()
    del outer
    residual = random_state(shapes, 3, 1e-6)
    codec = CodecParams(scheme=scheme)
    meter = _Meter()
    round_s: list[float] = []
    serial_store_s: list[float] = []
    update_bytes = 0
    baseline = current_rss_bytes() or 0
    job = publishing(store_root, shapes, codec, "bench")
    serial_job = dataclasses.replace(job, job="bench-serial")
    for chain in (job, serial_job):  # θ_0's snapshot opens each chain
        publish_initial(chain, theta, OuterOptimizer.from_state_dict(optimizer_state), _NOW)
    theta_hash = parameters_vector_hash(theta)
    for version in range(repeats):
        prepared = prefold(shapes, blobs, sources) if method == "folded" else None
        # Garbage in reference cycles (geofed.codec.decode leaves its result in one) is
        # freed before the round, so that each round starts from the resident state.
        gc.collect()
        meter.round_start = current_rss_bytes() or 0
        started = time.perf_counter()
        with meter.phase("aggregate"):
            if prepared is not None:
                mean = folded_mean(prepared)
                del prepared
            else:
                mean = mean_of(shapes, blobs, sources)
        # As in the daemon's publish_round: the step is taken in the state's own tensors
        # (θ, the momentum) and the mean's, which becomes the new residual.
        publication = publication_step(
            theta, mean, optimizer_state, residual, codec, phase=meter.phase, in_place=True
        )
        del mean
        state = WorkingState(version, theta, theta_hash, optimizer_state, residual)
        tokens = REGION_TOKENS * len(sources)
        with (
            meter.phase("store"),
            ThreadPoolExecutor(max_workers=3, thread_name_prefix="geofed-publish") as pool,
        ):
            stored, _, _, _ = store_round(job, state, publication, tokens, _NOW, pool)
        round_s.append(time.perf_counter() - started)
        # The baseline of the store phase, outside the round's time: the same writes one
        # after another, as the daemon did before it overlapped them.
        started = time.perf_counter()
        store_round(serial_job, state, publication, tokens, _NOW, None)
        serial_store_s.append(time.perf_counter() - started)
        theta, theta_hash, residual = stored.params, stored.params_hash, publication.residual
        optimizer_state = publication.optimizer_state
        update_bytes = publication.stream.total_bytes
        del publication, stored
    return {
        "method": method,
        "regions": len(sources),
        "round_s": round_s,
        "phase_s": meter.seconds,
        "phase_peak_growth_bytes": meter.growth,
        "peak_growth_bytes": max(meter.growth.values()),
        "resident_rss_bytes": baseline,
        "peak_per_phase_exact": meter.exact,
        "update_bytes": update_bytes,
        "serial_store_s": serial_store_s,
    }


def run_child(argv: Sequence[str]) -> int:
    """Entry point of a measuring process: ``CHILD_FLAG JSON``; prints one JSON line."""
    job = json.loads(argv[0])
    torch.set_num_threads(job["threads"])
    shapes = charlm_shapes(job["config"])
    blobs = FsBlobStore(job["spool"])
    sources = delta_sources(job["digests"][: job["regions"]])
    store_root = Path(job["spool"]) / f"published-{job['method']}-{job['regions']}"
    result = measure(
        job["method"], shapes, blobs, sources, job["scheme"], job["repeats"], store_root
    )
    print(json.dumps(result))
    return 0


def spawn(job: dict[str, Any]) -> dict[str, Any]:
    """Measure one (regions, method) in a fresh process, so no peak or cache carries over."""
    env = {**os.environ, **MALLOC_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.round_overhead", CHILD_FLAG, json.dumps(job)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"measuring {job['method']} with {job['regions']} regions failed "
            f"(exit {done.returncode}): {done.stderr.strip()[-2000:]}"
        )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# -- the report --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Settings:
    regions: tuple[int, ...]
    params: int
    scheme: Scheme
    repeats: int
    threads: int
    smoke: bool
    out: Path
    note: str


def region_counts(text: str) -> tuple[int, ...]:
    """``--regions``: a comma list of region counts, sorted, each at least 1."""
    try:
        values = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list like 2,4,8,16") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every region count must be >= 1")
    return values


def model_size(text: str) -> int:
    """A model size as an argparse type: a count like 25e6, at least 1000."""
    try:
        value = int(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number like 25e6") from None
    if value < 1000:
        raise argparse.ArgumentTypeError(f"--params must be at least 1000, got {text}")
    return value


def parse_args(argv: Sequence[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.round_overhead", description=__doc__
    )
    parser.add_argument("--regions", type=region_counts, help="default 2,4,8,16; smoke 2")
    parser.add_argument("--params", type=model_size, help="model size, default 25e6; smoke 1e6")
    parser.add_argument("--scheme", choices=SCHEMES, default="int8", help="default int8")
    parser.add_argument("--repeats", type=int, help="rounds per process, default 3; smoke 1")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--smoke", action="store_true", help="a run of a few seconds")
    parser.add_argument("--out", type=Path, help="JSON path; the markdown goes next to it")
    parser.add_argument("--note", default="", help="free text stored with the figures")
    args = parser.parse_args(argv)
    smoke = args.smoke
    repeats = args.repeats if args.repeats is not None else (1 if smoke else 3)
    if repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be >= 1")
    name = "round_overhead.smoke.json" if smoke else "round_overhead.json"
    return Settings(
        # One region count: each measurement starts a process, and importing torch is
        # most of a smoke run.
        regions=args.regions or ((2,) if smoke else (2, 4, 8, 16)),
        params=args.params or (1_000_000 if smoke else 25_000_000),
        scheme=args.scheme,
        repeats=repeats,
        threads=args.threads,
        smoke=smoke,
        out=args.out or RESULTS / name,
        note=args.note,
    )


def summarise(result: dict[str, Any], model_bytes: int) -> dict[str, Any]:
    """Add medians and multiples of the model size to one process's raw figures."""
    rounds = result["round_s"]
    return {
        **result,
        "round_s_median": statistics.median(rounds),
        "round_s_min": min(rounds),
        "phase_s_median": {k: statistics.median(v) for k, v in result["phase_s"].items()},
        "serial_store_s_median": statistics.median(result["serial_store_s"]),
        "peak_growth_x_model": result["peak_growth_bytes"] / model_bytes,
        "aggregate_growth_x_model": result["phase_peak_growth_bytes"]["aggregate"] / model_bytes,
        "resident_rss_x_model": result["resident_rss_bytes"] / model_bytes,
    }


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """DESIGN's memory target, for the aggregation alone and for the whole round.

    Growth is over the RSS at the start of the round, which already holds θ, the outer
    momentum and the update residual (3x model size between rounds).
    """
    checks: list[dict[str, Any]] = []
    counts = ", ".join(str(row["regions"]) for row in rows)
    for key, what in (
        ("aggregate_growth_x_model", "aggregation (decode into the weighted sum and mean)"),
        ("peak_growth_x_model", "whole round (aggregation to the published θ_{r+1})"),
    ):
        values = [row["streaming"][key] for row in rows]
        checks.append(
            {
                "name": f"{what} memory <= 3 x model size whatever the number of regions",
                "measured": f"streaming at most {max(values):.2f}x over {counts} regions "
                f"(spread {max(values) - min(values):.2f}x across region counts); naive "
                f"at most {max(row['naive'][key] for row in rows):.2f}x",
                "value": max(values),
                "met": max(values) <= 3.0,
            }
        )
    return checks


def render(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        "# Coordinator round overhead",
        "",
        f"Machine: {machine_line(report['machine'])}.",
        *([f"Note: {report['note']}"] if report["note"] else []),
        "",
        f"Model: {s['model']}; fp32 size {s['model_fp32_bytes'] / 2**20:.1f} MiB. Deltas "
        f"{s['scheme']}, {s['delta_bytes'] / 2**20:.1f} MiB each, pre-encoded; "
        f"{s['repeats']} round(s) per process, {s['torch_threads']} torch thread(s). "
        "Times are medians; memory is the peak RSS growth over the round's start, as a "
        "multiple of the fp32 model size.",
        "",
        *(f"> {note}" for note in report["notes"]),
        "",
        "| regions | folded on arrival s | streaming s | naive s | streaming / folded "
        "| naive / streaming | streaming peak (aggregate) | naive peak (aggregate) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        st, nv, fo = row["streaming"], row["naive"], row["folded"]
        lines.append(
            f"| {row['regions']} | {fo['round_s_median']:.3f} | {st['round_s_median']:.3f} | "
            f"{nv['round_s_median']:.3f} | {row['time_ratio_streaming_over_folded']:.2f} | "
            f"{row['time_ratio_naive_over_streaming']:.2f} | "
            f"{st['peak_growth_x_model']:.2f}x ({st['aggregate_growth_x_model']:.2f}x) | "
            f"{nv['peak_growth_x_model']:.2f}x ({nv['aggregate_growth_x_model']:.2f}x) |"
        )
    for method in ("streaming", "folded"):
        lines += [
            "",
            f"{method.capitalize()}, median seconds per phase:",
            "",
            "| regions | " + " | ".join(PHASES) + " |",
            "|---|" + "---|" * len(PHASES),
        ]
        for row in report["results"]:
            phases = row[method]["phase_s_median"]
            lines.append(
                f"| {row['regions']} | " + " | ".join(f"{phases[p]:.3f}" for p in PHASES) + " |"
            )
    lines += [
        "",
        "Store phase (θ_{r+1}'s working state, the signed update and a snapshot), median "
        "seconds: the daemon's writes side by side against the same writes one after another:",
        "",
        "| regions | method | side by side s | one after another s | serial / side by side |",
        "|---|---|---|---|---|",
    ]
    for row in report["results"]:
        for method in METHODS:
            figures = row[method]
            side, serial = figures["phase_s_median"]["store"], figures["serial_store_s_median"]
            lines.append(
                f"| {row['regions']} | {method} | {side:.3f} | {serial:.3f} | {serial / side:.2f} |"
            )
    lines += [
        "",
        "Streaming, peak RSS growth per phase (x model; the live results of earlier phases count):",
        "",
        "| regions | " + " | ".join(PHASES) + " |",
        "|---|" + "---|" * len(PHASES),
    ]
    model_bytes = s["model_fp32_bytes"]
    for row in report["results"]:
        growth = row["streaming"]["phase_peak_growth_bytes"]
        lines.append(
            f"| {row['regions']} | "
            + " | ".join(f"{growth[p] / model_bytes:.2f}x" for p in PHASES)
            + " |"
        )
    lines += targets_table(report["targets"])
    return "\n".join(lines) + "\n"


def run(settings: Settings) -> dict[str, Any]:
    config = charlm_config(settings.params)
    shapes = charlm_shapes(config)
    numel = _count(shapes)
    model_bytes = 4 * numel
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="geofed-round-overhead-") as spool:
        print(f"encoding {max(settings.regions)} deltas of {numel:,} parameters", file=sys.stderr)
        blobs = FsBlobStore(spool)
        digests = write_spool(shapes, settings.scheme, max(settings.regions), blobs)
        sizes = [blobs.size(digest) for digest in digests]
        for regions in settings.regions:
            row: dict[str, Any] = {"regions": regions}
            for method in METHODS:
                job = {
                    "method": method,
                    "regions": regions,
                    "config": config,
                    "spool": spool,
                    "digests": digests,
                    "scheme": settings.scheme,
                    "repeats": settings.repeats,
                    "threads": settings.threads,
                }
                row[method] = summarise(spawn(job), model_bytes)
                print(
                    f"  {regions} regions, {method}: {row[method]['round_s_median']:.3f} s, "
                    f"peak +{row[method]['peak_growth_x_model']:.2f}x model",
                    file=sys.stderr,
                    flush=True,
                )
            row["time_ratio_streaming_over_folded"] = (
                row["streaming"]["round_s_median"] / row["folded"]["round_s_median"]
            )
            row["time_ratio_naive_over_streaming"] = (
                row["naive"]["round_s_median"] / row["streaming"]["round_s_median"]
            )
            row["memory_ratio_naive_over_streaming"] = row["naive"]["peak_growth_bytes"] / max(
                1, row["streaming"]["peak_growth_bytes"]
            )
            rows.append(row)
    layout = ", ".join(f"{k}={v}" for k, v in config.items())
    return {
        "benchmark": "round_overhead",
        "machine": describe_machine(),
        "note": settings.note,
        "settings": {
            "model": f"charlm CharTransformer tensor layout ({layout}; {numel:,} parameters) "
            "with synthetic random values",
            "parameters": numel,
            "model_fp32_bytes": model_bytes,
            "scheme": settings.scheme,
            "delta_bytes": statistics.mean(sizes),
            "repeats": settings.repeats,
            "torch_threads": settings.threads,
            "regions": list(settings.regions),
            "smoke": settings.smoke,
            "malloc_env": MALLOC_ENV,
        },
        "notes": [
            "Each (regions, method) runs in a fresh process with MALLOC_MMAP_THRESHOLD_=131072 "
            "(glibc's initial value, fixed) so that RSS follows live tensors; freshly mapped "
            "memory then costs page faults each round, which the times include.",
            "Every region reports the same tokens, so the naive unweighted mean equals the "
            "weighted one. The streaming path is the coordinator's own (mean_delta over its "
            "blob store, then publication_step); naive differs from it in the aggregate "
            "phase only.",
            "Folded on arrival is the daemon's default path (rule mean, no norm check): each "
            "delta is verified by its upload (decoded once, nothing kept) and, once accepted, "
            "decoded again from its stored stream into the running sum, so at quorum the "
            "aggregate phase is the last delta's decoding and fold and the division; the "
            "earlier folds happen before quorum and are not timed here. Until quorum the "
            "coordinator holds the running sum (1x model) and no decoded delta. Streaming is "
            "the path a restarted coordinator, a norm check or a coordinate-wise rule takes.",
        ],
        "results": rows,
        "targets": targets(rows),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [CHILD_FLAG]:
        return run_child(args[1:])
    settings = parse_args(args)
    torch.set_num_threads(settings.threads)
    print(f"machine: {machine_line(describe_machine())}", file=sys.stderr)
    started = time.perf_counter()
    try:
        report = run(settings)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"round_overhead: {exc}", file=sys.stderr)
        return 1
    report["total_wall_s"] = time.perf_counter() - started
    publish(report, settings.out, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
