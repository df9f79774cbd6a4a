"""A convergence baseline that can be trusted: tuned learning rates, several seeds, and
every gap with its confidence.

    python -m benchmarks.baseline [--seeds 3] [--steps 1200] [--h 30] [--h-long 100]
        [--fragments 2] [--regions 2] [--lr-grid 0.0015,0.003,0.006] [--jobs 2]
        [--smoke] [--out PATH]

The synchronous baseline (data-parallel training over every region's data) and DiLoCo's
inner optimizer are tuned over the same learning-rate grid on seeds 0..N-1; the best of each
(lowest mean final validation loss) is kept, and the whole grid reported. The table then
runs on seeds N..2N-1, which took no part in the choice (so the chosen rows are not favoured
by the draw that chose them): both at their chosen rates and, at DiLoCo's, the rows of
Streaming DiLoCo's small-scale table (Douillard et al. 2025, 35M parameters on C4) at this
scale, beside the published figures: Streaming DiLoCo with each tensor synchronized every H
and every ``--h-long`` steps (``--fragments`` F fragments, rounds of H/F steps, θ back
before the next round's first step), and DiLoCo with twice the replicas (regions) at the
same tokens per step (each region's batch halved, the validation set kept). Every gap to the
synchronous baseline is paired by seed (:mod:`benchmarks._confidence`) and stated with its
95 % interval.

The round math is the daemons' own, in one process per run (:mod:`benchmarks._federation_sim`);
``--jobs`` runs that many at once, one torch thread each. Every configuration sees the same
tokens. Figures go to ``--out`` (JSON) and the same path with ``.md``; both are printed too.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import multiprocessing
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks._args import given, positive_floats
from benchmarks._confidence import Gap, paired_gap
from benchmarks._federation_sim import RunSpec, SimulationError, loss_stats, simulate, warm_up
from benchmarks._machine import describe_machine, machine_line, targets_table
from benchmarks._report import publish
from geofed.examples.charlm import CharLMOptions, CharLMTask

RESULTS = Path(__file__).resolve().parent / "results"

#: A ~1.07M-parameter byte-level LM (33 runs of 1,200 steps: about 90 minutes on 2 cores).
TASK_OPTIONS: dict[str, Any] = {"d_model": 128, "n_layers": 5, "n_heads": 4, "val_batches": 16}
SMOKE_OPTIONS: dict[str, Any] = {
    "d_model": 32,
    "n_layers": 1,
    "n_heads": 2,
    "seq_len": 32,
    "batch_size": 4,
    "val_batches": 2,
}

#: The table's rows, in its order.
ROWS = ("sync", "diloco", "streaming_h", "streaming_h_long", "replicas")
#: Streaming DiLoCo's small-scale table (35M parameters, C4): final evaluation loss.
PUBLISHED: dict[str, float] = {
    "sync": 3.51,
    "diloco": 3.54,
    "streaming_h": 3.53,
    "streaming_h_long": 3.56,
    "replicas": 3.60,
}


@dataclass(frozen=True, slots=True)
class Settings:
    seeds: int
    steps: int
    h: int
    h_long: int
    fragments: int
    regions: int
    lr_grid: tuple[float, ...]
    jobs: int
    smoke: bool
    out: Path
    task_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Job:
    """One run: a configuration ``config`` on one seed, with the task's options."""

    config: str
    spec: RunSpec
    options: tuple[tuple[str, Any], ...]


@functools.cache
def _task(options: tuple[tuple[str, Any], ...], regions: int) -> CharLMTask:
    """The task for ``options``, its data read and its first optimizer built once a
    process (so no timed run pays for them)."""
    task = CharLMTask(CharLMOptions.model_validate(dict(options)))
    warm_up(task, RunSpec("warm-up", "sync", regions, 1, 1, 1, seed=0))
    return task


def run_job(job: Job) -> dict[str, Any]:
    """Run ``job`` in this process (one torch thread) and return its figures."""
    torch.set_num_threads(1)
    result = simulate(_task(job.options, job.spec.regions), job.spec)
    return {
        "config": job.config,
        "seed": job.spec.seed,
        "final_val_loss": result.final_val_loss,
        "tokens": result.tokens,
        "wall_s": round(result.wall_s, 2),
        "curve": [[p.step, p.tokens, round(p.val_loss, 5)] for p in result.curve],
    }


def _lr_label(lr: float) -> str:
    return f"{lr:g}"


def grid_jobs(settings: Settings) -> list[Job]:
    """Synchronous and DiLoCo runs at every rate of the grid, on every seed."""
    jobs = []
    for lr in settings.lr_grid:
        options = _options(settings, lr=lr)
        for seed in range(settings.seeds):
            for method in ("sync", "diloco"):
                spec = RunSpec(
                    f"{method}@{_lr_label(lr)}",
                    method,
                    regions=settings.regions,
                    workers=1,
                    rounds=settings.steps // settings.h,
                    inner_steps=settings.h,
                    seed=seed,
                )
                jobs.append(Job(spec.name, spec, options))
    return jobs


def row_jobs(settings: Settings, chosen: dict[str, float]) -> list[Job]:
    """Every row of the table at its chosen rate (DiLoCo's for the variants), on the
    confirmation seeds: seeds the choice did not see, so the chosen rows are not favoured
    by the draw that chose them."""
    f, steps, h, lr = settings.fragments, settings.steps, settings.h, chosen["diloco"]
    diloco = {"rounds": steps // h, "inner_steps": h}
    rows: dict[str, tuple[str, dict[str, Any], tuple[tuple[str, Any], ...]]] = {
        "sync": ("sync", diloco, _options(settings, lr=chosen["sync"])),
        "diloco": ("diloco", diloco, _options(settings, lr=lr)),
        "streaming_h": ("diloco", _streaming(settings, h // f), _options(settings, lr=lr)),
        "streaming_h_long": (
            "diloco",
            _streaming(settings, settings.h_long // f),
            _options(settings, lr=lr),
        ),
        "replicas": (
            "diloco",
            {**diloco, "regions": 2 * settings.regions},
            _options(settings, lr=lr, halve_batch=True),
        ),
    }
    jobs = []
    for config, (method, shape, options) in rows.items():
        fields: dict[str, Any] = {"regions": settings.regions, **shape}
        for seed in confirmation_seeds(settings):
            spec = RunSpec(config, method, workers=1, seed=seed, **fields)  # type: ignore[arg-type]
            jobs.append(Job(config, spec, options))
    return jobs


def confirmation_seeds(settings: Settings) -> range:
    """The seeds of the table's rows: after the grid's."""
    return range(settings.seeds, 2 * settings.seeds)


def _streaming(settings: Settings, round_steps: int) -> dict[str, Any]:
    return {
        "rounds": settings.steps // round_steps,
        "inner_steps": round_steps,
        "overlap": "streaming",
        "fragments": settings.fragments,
        "arrival_fraction": 0.0,
    }


def _options(
    settings: Settings, *, lr: float, halve_batch: bool = False
) -> tuple[tuple[str, Any], ...]:
    options = {**settings.task_options, "lr": lr}
    if halve_batch:
        # The validation set is val_batches x batch_size windows: kept the same.
        base = CharLMOptions.model_validate(options)
        options["batch_size"] = base.batch_size // 2
        options["val_batches"] = base.val_batches * 2
    return tuple(sorted(options.items()))


def run_all(jobs: Sequence[Job], workers: int) -> list[dict[str, Any]]:
    """Every job's figures, in the jobs' order; ``workers`` > 1 runs them in processes."""
    if workers == 1:
        return [run_job(job) for job in jobs]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        return list(pool.map(run_job, jobs))


def by_config(results: Iterable[dict[str, Any]]) -> dict[str, list[float]]:
    """config -> final losses in seed order."""
    finals: dict[str, dict[int, float]] = {}
    for result in results:
        finals.setdefault(result["config"], {})[result["seed"]] = result["final_val_loss"]
    return {config: [seeds[s] for s in sorted(seeds)] for config, seeds in finals.items()}


def best_rate(finals: dict[str, list[float]], method: str, grid: Sequence[float]) -> float:
    """The grid rate whose mean final loss is lowest for ``method`` (ties: the lower rate)."""
    return min(grid, key=lambda lr: (_mean(finals[f"{method}@{_lr_label(lr)}"]), lr))


def chosen_rates(finals: dict[str, list[float]], grid: Sequence[float]) -> dict[str, float]:
    """The best rate of the synchronous baseline and of DiLoCo's inner optimizer."""
    return {method: best_rate(finals, method, grid) for method in ("sync", "diloco")}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def checks(
    rows: dict[str, list[float]],
    gaps: dict[str, Gap],
    chosen: dict[str, float],
    grid: Sequence[float],
) -> list[dict[str, Any]]:
    """What the run says about its own trustworthiness (``met``: True, False or None)."""
    sync_std = float(loss_stats(rows["sync"])["std"])
    smallest = min(abs(gap.mean) for gap in gaps.values())
    found = [
        {
            "name": "synchronous seed spread (std) below half of every gap it is compared with",
            "measured": f"std {sync_std:.4f}; smallest gap {smallest:.4f}",
            "met": sync_std < smallest / 2,
        }
    ]
    for method, lr in chosen.items():
        inside = min(grid) < lr < max(grid)
        found.append(
            {
                "name": f"{method}: the best rate lies inside the grid, not at its edge",
                "measured": f"{_lr_label(lr)} of {', '.join(map(_lr_label, grid))}",
                "met": inside,
            }
        )
    for config, gap in gaps.items():
        found.append(
            {
                "name": f"gap {config} vs synchronous, resolved by the seeds (95% CI excludes 0)",
                "measured": gap.describe(),
                "met": None if gap.resolved is None else gap.resolved,
            }
        )
    ours = sorted(rows, key=lambda name: _mean(rows[name]))
    theirs = sorted(PUBLISHED, key=PUBLISHED.__getitem__)
    found.append(
        {
            "name": "ordering of the rows, lowest loss first, as published",
            "measured": f"ours {' < '.join(ours)}; published {' < '.join(theirs)}",
            "met": None,
        }
    )
    return found


def report(
    settings: Settings,
    results: list[dict[str, Any]],
    wall_s: float,
    labels: dict[str, str],
) -> tuple[dict[str, Any], str]:
    """The JSON report and its markdown."""
    finals = by_config(results)
    chosen = chosen_rates(finals, settings.lr_grid)
    rows = {name: finals[name] for name in ROWS}
    gaps = {
        name: paired_gap(rows["sync"], losses) for name, losses in rows.items() if name != "sync"
    }
    found = checks(rows, gaps, chosen, settings.lr_grid)
    task = CharLMTask(CharLMOptions.model_validate(settings.task_options))
    params = sum(p.numel() for p in task.build_model(seed=0).parameters())
    machine = describe_machine()
    data = {
        "benchmark": "baseline",
        "machine": machine,
        "settings": {
            **{k: v for k, v in dataclasses.asdict(settings).items() if k != "out"},
            "parameters": params,
        },
        "chosen_lr": chosen,
        "grid": {name: loss_stats(v) | {"finals": v} for name, v in finals.items() if "@" in name},
        "rows": {name: loss_stats(v) | {"finals": v} for name, v in rows.items()},
        "gaps_vs_sync": {
            name: {"mean": g.mean, "low": g.low, "high": g.high, "relative": g.relative, "n": g.n}
            for name, g in gaps.items()
        },
        "published": PUBLISHED,
        "checks": found,
        "runs": results,
        "wall_s": round(wall_s, 1),
    }
    return data, _markdown(settings, data, gaps, labels, params)


def _stats_text(stats: dict[str, Any]) -> str:
    return f"{stats['mean']:.4f} ± {stats['std']:.4f} (n={stats['n']})"


def _markdown(
    settings: Settings,
    data: dict[str, Any],
    gaps: dict[str, Gap],
    labels: dict[str, str],
    params: int,
) -> str:
    chosen = data["chosen_lr"]
    lines = [
        "# A convergence baseline that can be trusted",
        "",
        f"Machine: {machine_line(data['machine'])}.",
        "",
        f"Task: charlm ({params:,} parameters), {settings.regions} regions, {settings.steps} "
        f"steps per run (equal tokens for every row); seeds 0..{settings.seeds - 1} choose "
        f"the rates, seeds {settings.seeds}..{2 * settings.seeds - 1} run the table; "
        f"{settings.jobs} run(s) at once, one torch thread each. Total wall time "
        f"{data['wall_s']:.0f} s.",
        "",
        "## Learning-rate grid (final validation loss, mean ± std over seeds)",
        "",
        f"| lr | synchronous | DiLoCo H={settings.h} (inner lr) |",
        "|---|---|---|",
    ]
    for lr in settings.lr_grid:
        cells = []
        for method in ("sync", "diloco"):
            text = _stats_text(data["grid"][f"{method}@{_lr_label(lr)}"])
            cells.append(f"**{text}**" if chosen[method] == lr else text)
        lines.append(f"| {_lr_label(lr)} | {cells[0]} | {cells[1]} |")
    sync_published = PUBLISHED["sync"]
    lines += [
        "",
        f"Chosen (bold): synchronous lr {_lr_label(chosen['sync'])}, DiLoCo inner lr "
        f"{_lr_label(chosen['diloco'])}; every other row uses DiLoCo's. The table runs "
        "every row again at these rates on seeds that took no part in the choice.",
        "",
        "## Rows, against the synchronous baseline (gaps paired by seed, 95% CI)",
        "",
        "| row | final val loss | vs synchronous | published (35M, C4) "
        "| published vs data-parallel |",
        "|---|---|---|---|---|",
    ]
    for name, stats in data["rows"].items():
        gap = gaps[name].describe() if name in gaps else ""
        published = PUBLISHED[name]
        relative = "" if name == "sync" else f"{published / sync_published - 1:+.2%}"
        lines.append(
            f"| {labels[name]} | {_stats_text(stats)} | {gap} | {published:.2f} | {relative} |"
        )
    lines += targets_table(data["checks"])
    return "\n".join(lines) + "\n"


def row_labels(settings: Settings) -> dict[str, str]:
    f = settings.fragments
    return {
        "sync": "synchronous (data-parallel)",
        "diloco": f"DiLoCo H={settings.h}",
        "streaming_h": f"Streaming DiLoCo H={settings.h} (F={f}, rounds of {settings.h // f})",
        "streaming_h_long": (
            f"Streaming DiLoCo H={settings.h_long} (F={f}, rounds of {settings.h_long // f})"
        ),
        "replicas": f"DiLoCo H={settings.h}, {2 * settings.regions} replicas (batch halved)",
    }


def parse(argv: Sequence[str] | None) -> Settings:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.baseline", description=__doc__)
    parser.add_argument(
        "--seeds",
        type=int,
        help="seeds per row (default 3; smoke 2): 0..N-1 choose the rates, N..2N-1 run the table",
    )
    parser.add_argument("--steps", type=int, help="steps per run (default 1200; smoke 8)")
    parser.add_argument("--h", type=int, help="DiLoCo's inner steps H (default 30; smoke 4)")
    parser.add_argument("--h-long", type=int, help="the longer streaming H (default 100; smoke 8)")
    parser.add_argument("--fragments", type=int, default=2, help="streaming fragments F")
    parser.add_argument("--regions", type=int, default=2, help="regions (replicas)")
    parser.add_argument(
        "--lr-grid", type=positive_floats, help="rates (default 0.0015,0.003,0.006)"
    )
    parser.add_argument("--jobs", type=int, help="runs at once (default 2; smoke 1)")
    parser.add_argument("--smoke", action="store_true", help="a run of a few seconds")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    smoke = args.smoke
    settings = Settings(
        seeds=given(args.seeds, 2 if smoke else 3),
        steps=given(args.steps, 8 if smoke else 1200),
        h=given(args.h, 4 if smoke else 30),
        h_long=given(args.h_long, 8 if smoke else 100),
        fragments=args.fragments,
        regions=args.regions,
        lr_grid=args.lr_grid or ((0.003, 0.006) if smoke else (0.0015, 0.003, 0.006)),
        jobs=given(args.jobs, 1 if smoke else 2),
        smoke=smoke,
        out=args.out or RESULTS / ("baseline.smoke.json" if smoke else "baseline.json"),
        task_options=SMOKE_OPTIONS if smoke else TASK_OPTIONS,
    )
    problem = _problem(settings)
    if problem is not None:
        parser.error(problem)
    return settings


def _problem(s: Settings) -> str | None:
    """Why ``s`` cannot give equal tokens and paired seeds, or None."""
    if s.seeds < 2:
        return f"--seeds {s.seeds}: a confidence interval needs at least 2 seeds"
    if min(s.steps, s.regions, s.fragments, s.jobs, s.h, s.h_long) < 1:
        return "--steps, --regions, --fragments, --jobs, --h and --h-long must be >= 1"
    for h in (s.h, s.h_long):
        if h % s.fragments:
            return f"H {h}, --fragments {s.fragments}: F must divide H (rounds of H/F steps)"
        if s.steps % h or s.steps % (h // s.fragments):
            return (
                f"--steps {s.steps}, H {h}: H and H/F must divide the steps, for every row "
                "to see the same tokens"
            )
    if CharLMOptions.model_validate(s.task_options).batch_size % 2:
        return "the replicas row halves the batch: batch_size must be even"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0, or 1 when a run diverged."""
    settings = parse(argv)
    started = time.perf_counter()
    try:
        grid = run_all(grid_jobs(settings), settings.jobs)
        chosen = chosen_rates(by_config(grid), settings.lr_grid)
        rows = run_all(row_jobs(settings, chosen), settings.jobs)
    except SimulationError as exc:
        print(f"baseline: {exc}", file=sys.stderr)
        return 1
    data, markdown = report(
        settings, [*grid, *rows], time.perf_counter() - started, row_labels(settings)
    )
    publish(data, settings.out, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
