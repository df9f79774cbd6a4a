"""Convergence at equal tokens: synchronous training, DiLoCo fp32/int8/int4, plain averaging.

Trains the bundled example task (``geofed.examples.charlm``: a byte-level LM on the
standard library's source, each region on its own packages) in one process with
geofed's round math (see :mod:`benchmarks._federation_sim`) and reports final
validation loss, WAN bytes (encoded, and their fp32 equivalent) and wall time per
configuration, with the spread over seeds, and checks them against DESIGN's targets.

    python -m benchmarks.convergence [--regions 3] [--rounds 12] [--inner-steps 25]
        [--seeds 2] [--workers 1] [--threads 1] [--fragments 4] [--smoke] [--out PATH]
        [--note TEXT]
    python -m benchmarks.convergence --sweep [--sweep-h 10,25,50,100] [--warm-start-steps N]
    python -m benchmarks.convergence --robust [--regions 5] [--rounds 6] [--inner-steps 10]
    python -m benchmarks.convergence --outer-sweep [--sweep-lr 0.3,0.5,0.7,1.0]
        [--sweep-momentum 0,0.5,0.8,0.9] [--sweep-warmup 0,4] [--choice-seed 0]
        [--confirm-seeds 1,2]
    python -m benchmarks.convergence --overlap-sweep [--sweep-mix 0,0.25,0.5,0.75,1]
        [--sweep-start local,global,eager] [--arrivals 1,0.5] [--sweep-lr 0.2,0.3,0.5]
        [--sweep-momentum 0,0.5,0.8] [--sweep-warmup 4] [--choice-seed 0] [--confirm-seeds 1,2]

``--sweep`` measures instead how the DiLoCo/synchronous gap moves with H and with a
synchronous warm start (the DiLoCo paper's protocol) at the same total tokens, and
writes ``convergence_sweep.json``. ``--robust`` measures the job's aggregation rules
(``coordinator.aggregation.config``): what each costs in loss with honest regions and what
it saves when one region sends its delta scaled or sign-flipped, and writes
``robust_aggregation.json``. ``--outer-sweep`` sweeps the outer optimizer's lr, momentum
and momentum warm-up on one seed, picks the lowest final loss, and confirms it against
plain averaging on other seeds, and writes ``outer_sweep.json``. The main table also has
rows for ``overlap: delayed`` (the one-step delayed outer update; see
:mod:`benchmarks._federation_sim`) and ``overlap: streaming`` with ``--fragments`` F: once
with rounds of H steps (each tensor synchronized every F·H steps) and once with rounds of
about H/F steps (each tensor synchronized about every H steps, as ``none`` at H: Streaming
DiLoCo's setting; once more with no delay, to tell the fragments' cost from the delay's),
all at the same tokens as every other row. ``--overlap-sweep`` measures corrections of the
delayed fold (the mix a, the start of a round, then the outer optimizer) against
``overlap: none`` at equal tokens: chosen on one seed over every arrival time, confirmed on
others, and writes ``overlap_sweep.json``. Figures go to ``--out`` (JSON) and the same
path with ``.md`` (a markdown table); both are printed too.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks._federation_sim import (
    ATTACK_FACTORS,
    DelayedStart,
    RunResult,
    RunSpec,
    SimulationError,
    loss_stats,
    simulate,
    warm_up,
)
from benchmarks._machine import describe_machine, machine_line, targets_table
from benchmarks._report import publish
from coordinator.aggregation.config import AggregationConfig
from coordinator.aggregation.outer_optimizer import OuterOptimizerConfig
from geofed.examples.charlm import CharLMOptions, CharLMTask

RESULTS = Path(__file__).resolve().parent / "results"

SIMULATION_NOTE = (
    "Regions are simulated in one process: a region with W workers at local batch b is "
    "equivalent, for this purpose, to one model at batch W*b (here: the W rank shards' "
    "gradients accumulated with weight 1/W, as DDP's all-reduce averages them)."
)

#: name -> (label, RunSpec fields); every DiLoCo variant uses the outer optimizer's defaults.
MAIN_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "sync": ("synchronous baseline", {"method": "sync"}),
    "diloco_fp32": ("DiLoCo fp32", {"method": "diloco", "scheme": "fp32"}),
    "diloco_int8": ("DiLoCo int8", {"method": "diloco", "scheme": "int8"}),
    "diloco_int4": ("DiLoCo int4", {"method": "diloco", "scheme": "int4"}),
    "fedavg": (
        "plain averaging (FedAvg: outer lr 1.0, momentum 0), fp32",
        {"method": "diloco", "scheme": "fp32", "outer": OuterOptimizerConfig(kind="average")},
    ),
    "delayed_end": (
        "DiLoCo fp32, overlap delayed (θ arrives at the end of the next inner phase)",
        {"method": "diloco", "scheme": "fp32", "overlap": "delayed", "arrival_fraction": 1.0},
    ),
    "delayed_half": (
        "DiLoCo fp32, overlap delayed (θ arrives half-way through the next inner phase)",
        {"method": "diloco", "scheme": "fp32", "overlap": "delayed", "arrival_fraction": 0.5},
    ),
}

#: The overlap rows' reference: the same outer optimizer and codec without overlap.
OVERLAP_CONFIGS = ("delayed_end", "delayed_half")
#: The streaming rows (see :func:`main_configs`), compared with the same reference.
STREAMING_CONFIGS = ("streaming_same_h", "streaming_h_over_f", "streaming_h_over_f_no_delay")
OVERLAP_NOTE = (
    "Overlap: `none` is the DiLoCo fp32 row (a region waits for θ_(r+1) before its next "
    "inner phase). `delayed`: a region trains on from its own parameters and applies "
    "θ_(r+1) - (its parameters when it sent Δ_r) when θ_(r+1) arrives, at the end of the "
    "inner phase (communication that takes a whole phase: the worst case the mode accepts "
    "without waiting) or half-way. `streaming` (Streaming DiLoCo): delayed, and round r "
    "synchronizes only fragment r mod F of the model's tensors (geofed.fragments): the "
    "deltas, the outer step and the update cover those tensors, a region folds only them "
    "when θ_(r+1) arrives (at the end of the next inner phase unless the row says "
    "otherwise) and trains the others on locally. With rounds of H steps each tensor is "
    "synchronized every F·H steps; with rounds of about H/F steps (F times as many rounds, "
    "each moving about 1/F of the model) about every H steps, as `none` does; that setting "
    "runs once more with θ arriving before the next phase's first step (no delay), which "
    "separates what the fragments cost from what the delay costs. Every row sees the same "
    "tokens. The final loss is that of the coordinator's θ: under streaming, the last F-1 "
    "rounds' fragments hold up to F-1 rounds of local progress that θ never receives."
)

#: The outer configurations a sweep confirms its choice against, on the other seeds.
PLAIN_AVERAGING = OuterOptimizerConfig(kind="average")
DILOCO_PAPER = OuterOptimizerConfig(lr=0.7, momentum=0.9, momentum_warmup_rounds=0)


#: rule -> (label, AggregationConfig); each runs with honest regions and with each attack.
ROBUST_RULES: dict[str, tuple[str, AggregationConfig]] = {
    "mean": ("token-weighted mean", AggregationConfig()),
    "mean_clip": (
        "mean, norm clipped at 3x the median",
        AggregationConfig(norm_check="clip", max_norm_ratio=3.0),
    ),
    "trimmed_mean": (
        "trimmed mean (20% each end)",
        AggregationConfig(rule="trimmed_mean", trim_fraction=0.2),
    ),
    "median": ("coordinate-wise median", AggregationConfig(rule="median")),
}
ATTACKS = tuple(ATTACK_FACTORS)


@dataclass(frozen=True, slots=True)
class Settings:
    regions: int
    workers: int
    rounds: int
    inner_steps: int
    seeds: int
    threads: int
    smoke: bool
    sweep: bool
    robust: bool
    outer_sweep: bool
    overlap_sweep: bool
    fragments: int
    sweep_mix: tuple[float, ...]
    sweep_start: tuple[DelayedStart, ...]
    arrivals: tuple[float, ...]
    sweep_lr: tuple[float, ...]
    sweep_momentum: tuple[float, ...]
    sweep_warmup: tuple[int, ...]
    choice_seed: int
    confirm_seeds: tuple[int, ...]
    sweep_h: tuple[int, ...]
    warm_start_steps: int
    out: Path
    note: str
    task_options: dict[str, Any]


def _int_list(text: str, minimum: int = 1) -> tuple[int, ...]:
    """Comma-separated integers >= ``minimum``."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= {minimum}")
    return values


def _float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of numbers"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: no values")
    return values


def _count_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers >= 0."""
    return _int_list(text, minimum=0)


def sweep_outer_configs(settings: Settings) -> dict[str, OuterOptimizerConfig]:
    """name -> config for every lr x momentum x warm-up of the sweep (warm-up needs momentum)."""
    configs: dict[str, OuterOptimizerConfig] = {}
    for warmup in settings.sweep_warmup:
        for lr in settings.sweep_lr:
            for momentum in settings.sweep_momentum:
                if warmup and not momentum:
                    continue
                if lr == 1.0 and momentum == 0.0:
                    config = PLAIN_AVERAGING
                else:
                    config = OuterOptimizerConfig(
                        lr=lr, momentum=momentum, momentum_warmup_rounds=warmup
                    )
                configs[f"lr{lr:g}_m{momentum:g}_w{warmup}"] = config
    # The reference every row is compared with, whether or not the grid holds it.
    configs.setdefault("lr1_m0_w0", PLAIN_AVERAGING)
    return configs


def _start_list(text: str) -> tuple[DelayedStart, ...]:
    values = tuple(part.strip() for part in text.split(","))
    for value in values:
        if value not in DELAYED_STARTS:
            raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(DELAYED_STARTS)}")
    return values  # type: ignore[return-value]


DELAYED_STARTS: tuple[DelayedStart, ...] = ("local", "global", "eager")


def parse_args(argv: Sequence[str] | None) -> Settings:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.convergence", description=__doc__)
    parser.add_argument("--regions", type=int, help="regions (default 3; smoke 2)")
    parser.add_argument("--workers", type=int, default=1, help="workers per region (default 1)")
    parser.add_argument("--rounds", type=int, help="outer rounds (default 12; smoke 2)")
    parser.add_argument("--inner-steps", type=int, help="inner steps H (default 25; smoke 3)")
    parser.add_argument("--seeds", type=int, help="seeds 0..N-1 (default 2; smoke 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--fragments", type=int, default=4, help="F of the overlap streaming rows (default 4)"
    )
    parser.add_argument("--smoke", action="store_true", help="a run of a few seconds")
    parser.add_argument("--sweep", action="store_true", help="H and warm-start sweep instead")
    parser.add_argument(
        "--robust", action="store_true", help="aggregation rules under attack instead"
    )
    parser.add_argument("--sweep-h", type=_int_list, help="H values (default 10,25,50,100)")
    parser.add_argument(
        "--outer-sweep", action="store_true", help="outer lr / momentum / warm-up sweep instead"
    )
    parser.add_argument("--sweep-lr", type=_float_list, help="outer lrs (default 0.3,0.5,0.7,1.0)")
    parser.add_argument(
        "--sweep-momentum", type=_float_list, help="outer momenta (default 0,0.5,0.8,0.9)"
    )
    parser.add_argument(
        "--sweep-warmup", type=_count_list, help="momentum warm-up rounds (default 0,4)"
    )
    parser.add_argument(
        "--overlap-sweep", action="store_true", help="corrections of overlap: delayed instead"
    )
    parser.add_argument(
        "--sweep-mix", type=_float_list, help="fold mixes a (default 0,0.25,0.5,0.75,1)"
    )
    parser.add_argument(
        "--sweep-start", type=_start_list, help="round starts (default local,global,eager)"
    )
    parser.add_argument("--arrivals", type=_float_list, help="θ arrival fractions (default 1,0.5)")
    parser.add_argument("--choice-seed", type=int, default=0, help="seed the choice is made on")
    parser.add_argument(
        "--confirm-seeds", type=_count_list, help="seeds that confirm the choice (default 1,2)"
    )
    parser.add_argument("--warm-start-steps", type=int, help="default: a third of all steps")
    parser.add_argument("--out", type=Path, help="JSON path; the markdown goes next to it")
    parser.add_argument("--note", default="", help="free text stored with the figures")
    args = parser.parse_args(argv)
    smoke = args.smoke
    if sum((args.sweep, args.robust, args.outer_sweep, args.overlap_sweep)) > 1:
        parser.error("--sweep, --robust, --outer-sweep and --overlap-sweep are separate runs")
    rounds = args.rounds or (2 if smoke else 6 if args.robust else 12)
    inner_steps = args.inner_steps or (3 if smoke else 10 if args.robust else 25)
    total = rounds * inner_steps
    stem = "convergence"
    if args.sweep or args.robust or args.outer_sweep or args.overlap_sweep:
        stem = (
            "convergence_sweep"
            if args.sweep
            else "robust_aggregation"
            if args.robust
            else "outer_sweep"
            if args.outer_sweep
            else "overlap_sweep"
        )
    out = args.out or RESULTS / (f"{stem}.smoke.json" if smoke else f"{stem}.json")
    for name in ("regions", "rounds", "inner_steps", "seeds", "workers", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not 2 <= args.fragments <= 64:
        parser.error(f"--fragments must be in 2..64 (1 is overlap delayed), got {args.fragments}")
    warm = args.warm_start_steps if args.warm_start_steps is not None else total // 3
    if not 0 <= warm < total:
        parser.error(f"--warm-start-steps must be in [0, {total}), got {warm}")
    sweep_h = args.sweep_h or ((1, 2) if smoke else (10, 25, 50, 100))
    confirm_seeds = args.confirm_seeds or ((1,) if smoke else (1, 2))
    if args.choice_seed < 0 or args.choice_seed in confirm_seeds:
        parser.error(
            f"--choice-seed {args.choice_seed} must be >= 0 and not one of the confirming "
            f"seeds {list(confirm_seeds)}"
        )
    if args.overlap_sweep:
        sweep_lr = args.sweep_lr or ((0.5,) if smoke else (0.2, 0.3, 0.5))
        sweep_momentum = args.sweep_momentum or ((0.0,) if smoke else (0.0, 0.5, 0.8))
        sweep_warmup = args.sweep_warmup or (4,)
    else:
        sweep_lr = args.sweep_lr or ((0.7, 1.0) if smoke else (0.3, 0.5, 0.7, 1.0))
        sweep_momentum = args.sweep_momentum or ((0.0, 0.9) if smoke else (0.0, 0.5, 0.8, 0.9))
        sweep_warmup = args.sweep_warmup or ((0, 1) if smoke else (0, 4))
    sweep_mix = args.sweep_mix or ((0.5, 1.0) if smoke else (0.0, 0.25, 0.5, 0.75, 1.0))
    arrivals = args.arrivals or ((1.0,) if smoke else (1.0, 0.5))
    for value in (*sweep_mix, *arrivals):
        if not 0.0 <= value <= 1.0:
            parser.error(f"--sweep-mix and --arrivals values must be in [0, 1], got {value:g}")
    for lr in sweep_lr:
        if not 0.0 < lr < float("inf"):
            parser.error(f"--sweep-lr values must be > 0, got {lr:g}")
    for momentum in sweep_momentum:
        if not 0.0 <= momentum < 1.0:
            parser.error(f"--sweep-momentum values must be in [0, 1), got {momentum:g}")
    if args.sweep:
        for h in sweep_h:
            if total % h or (total - warm) % h:
                parser.error(
                    f"H={h} must divide the {total} total steps and the {total - warm} steps "
                    "after the warm start, so that every run sees the same tokens"
                )
    return Settings(
        regions=args.regions or (5 if args.robust else 2 if smoke else 3),
        workers=args.workers,
        rounds=rounds,
        inner_steps=inner_steps,
        seeds=args.seeds or (1 if smoke or args.robust else 2),
        threads=args.threads,
        smoke=smoke,
        sweep=args.sweep,
        robust=args.robust,
        outer_sweep=args.outer_sweep,
        overlap_sweep=args.overlap_sweep,
        fragments=args.fragments,
        sweep_mix=sweep_mix,
        sweep_start=args.sweep_start or (("local", "eager") if smoke else DELAYED_STARTS),
        arrivals=arrivals,
        sweep_lr=sweep_lr,
        sweep_momentum=sweep_momentum,
        sweep_warmup=sweep_warmup,
        choice_seed=args.choice_seed,
        confirm_seeds=confirm_seeds,
        sweep_h=sweep_h,
        warm_start_steps=warm,
        out=out,
        note=args.note,
        # Smoke: batches of 4 sequences of 32 bytes (the task's defaults: 16 of 64), so
        # that a step and an evaluation take milliseconds; the code paths are a full run's.
        task_options={"val_batches": 2, "batch_size": 4, "seq_len": 32} if smoke else {},
    )


def _run(task: CharLMTask, spec: RunSpec) -> RunResult:
    result = simulate(task, spec)
    print(
        f"  seed {spec.seed} {spec.name}: val_loss {result.final_val_loss:.4f}, "
        f"{result.wall_s:.1f} s (train {result.train_s:.1f}, comm {result.comm_s:.2f}, "
        f"eval {result.eval_s:.1f})",
        file=sys.stderr,
        flush=True,
    )
    return result


def _spec(settings: Settings, name: str, inner_steps: int, rounds: int) -> RunSpec:
    return RunSpec(
        name=name,
        method="sync",
        regions=settings.regions,
        workers=settings.workers,
        rounds=rounds,
        inner_steps=inner_steps,
        seed=0,
    )


def streaming_round_steps(inner_steps: int, fragments: int, total_steps: int) -> int:
    """Inner steps of a streaming round that synchronizes each tensor about every
    ``inner_steps`` steps: the divisor of ``total_steps`` nearest H/F (the smaller one on a
    tie), so that the run sees the same tokens as every other."""
    target = inner_steps / fragments
    divisors = [d for d in range(1, total_steps + 1) if total_steps % d == 0]
    return min(divisors, key=lambda d: (abs(d - target), d))


def main_configs(settings: Settings) -> dict[str, tuple[str, dict[str, Any]]]:
    """:data:`MAIN_CONFIGS` and the streaming rows for ``settings``' H and F."""
    fragments, h = settings.fragments, settings.inner_steps
    total = settings.rounds * h
    short = streaming_round_steps(h, fragments, total)
    streaming: dict[str, Any] = {
        "method": "diloco",
        "scheme": "fp32",
        "overlap": "streaming",
        "fragments": fragments,
        "arrival_fraction": 1.0,
    }
    approx = "" if short * fragments == h else "about "
    return {
        **MAIN_CONFIGS,
        "streaming_same_h": (
            f"DiLoCo fp32, overlap streaming F={fragments}, {settings.rounds} rounds of H={h} "
            f"steps (each tensor synced every {fragments * h} steps; θ arrives at the end of "
            "the next inner phase)",
            streaming,
        ),
        "streaming_h_over_f": (
            f"DiLoCo fp32, overlap streaming F={fragments}, {total // short} rounds of {short} "
            f"steps, {approx}H/F (each tensor synced every {fragments * short} steps; θ "
            "arrives at the end of the next inner phase)",
            {**streaming, "inner_steps": short, "rounds": total // short},
        ),
        # What the fragments cost without any delay, to tell the two costs apart.
        "streaming_h_over_f_no_delay": (
            f"DiLoCo fp32, overlap streaming F={fragments}, {total // short} rounds of {short} "
            f"steps, {approx}H/F (each tensor synced every {fragments * short} steps; θ "
            "arrives before the next inner phase's first step: no delay)",
            {
                **streaming,
                "inner_steps": short,
                "rounds": total // short,
                "arrival_fraction": 0.0,
            },
        ),
    }


def run_main(task: CharLMTask, settings: Settings) -> dict[str, list[RunResult]]:
    """Run every main configuration for every seed (seeds outermost, so load drifts even out)."""
    configs = main_configs(settings)
    results: dict[str, list[RunResult]] = {name: [] for name in configs}
    warm_up(task, _spec(settings, "sync", settings.inner_steps, settings.rounds))
    for seed in range(settings.seeds):
        for name, (_, fields) in configs.items():
            spec = replace(
                _spec(settings, name, settings.inner_steps, settings.rounds), seed=seed, **fields
            )
            results[name].append(_run(task, spec))
    return results


def run_robust(task: CharLMTask, settings: Settings) -> dict[str, list[RunResult]]:
    """DiLoCo fp32 under each aggregation rule, with honest regions and under each attack."""
    base = replace(
        _spec(settings, "robust", settings.inner_steps, settings.rounds),
        method="diloco",
        scheme="fp32",
    )
    warm_up(task, base)
    results: dict[str, list[RunResult]] = {}
    for seed in range(settings.seeds):
        for rule, (_, config) in ROBUST_RULES.items():
            for attack in ATTACKS:
                name = f"{rule}/{attack}"
                spec = replace(base, name=name, seed=seed, aggregation=config, attack=attack)
                results.setdefault(name, []).append(_run(task, spec))
    return results


def robust_rows(runs: dict[str, list[RunResult]]) -> list[dict[str, Any]]:
    """Per rule: final loss under each attack, and its difference to the honest mean's."""
    rows: list[dict[str, Any]] = []
    for rule, (label, config) in ROBUST_RULES.items():
        row: dict[str, Any] = {"rule": rule, "label": label, "config": config.model_dump()}
        for attack in ATTACKS:
            name = f"{rule}/{attack}"
            row[attack] = {
                "final_val_loss": loss_stats(r.final_val_loss for r in runs[name]),
                "vs_honest_mean": compare(runs, name, "mean/none"),
            }
        rows.append(row)
    return rows


def run_sweep(task: CharLMTask, settings: Settings) -> dict[str, list[RunResult]]:
    """Run the synchronous baseline and DiLoCo fp32 for each H, cold and warm-started."""
    total = settings.rounds * settings.inner_steps
    base = _spec(settings, "sync", settings.sweep_h[0], total // settings.sweep_h[0])
    warm_up(task, base)
    results: dict[str, list[RunResult]] = {"sync": []}
    for seed in range(settings.seeds):
        results["sync"].append(_run(task, replace(base, seed=seed)))
        for h in settings.sweep_h:
            for warm in sorted({0, settings.warm_start_steps}):
                name = f"diloco_h{h}_warm{warm}"
                spec = replace(
                    base,
                    name=name,
                    method="diloco",
                    inner_steps=h,
                    rounds=(total - warm) // h,
                    warmup_steps=warm,
                    seed=seed,
                )
                results.setdefault(name, []).append(_run(task, spec))
    return results


# -- figures -------------------------------------------------------------------------


def _mean(values: Iterable[float]) -> float:
    data = list(values)
    return sum(data) / len(data)


def _run_record(result: RunResult) -> dict[str, Any]:
    return {
        "seed": result.spec.seed,
        "final_val_loss": result.final_val_loss,
        "tokens": result.tokens,
        "wall_s": result.wall_s,
        "train_s": result.train_s,
        "comm_s": result.comm_s,
        "eval_s": result.eval_s,
        "bytes_up": result.bytes_up,
        "bytes_down": result.bytes_down,
        "fp32_bytes_up": result.fp32_bytes_up,
        "fp32_bytes_down": result.fp32_bytes_down,
        "max_delta_ratio": result.max_delta_ratio,
        "max_update_ratio": result.max_update_ratio,
        "max_round_region_ratio": result.max_round_region_ratio,
        "curve": [[p.step, p.tokens, p.val_loss] for p in result.curve],
    }


def config_summary(label: str, results: list[RunResult], model_bytes: int) -> dict[str, Any]:
    """Summarise one configuration's runs (one per seed)."""
    spec = results[0].spec
    summary: dict[str, Any] = {
        "label": label,
        "method": spec.method,
        "inner_steps": spec.inner_steps,
        "rounds": spec.rounds if spec.method == "diloco" else None,
        "warm_start_steps": spec.warmup_steps,
        "total_steps": spec.total_steps,
        "tokens": results[0].tokens,
        "initial_val_loss": results[0].curve[0].val_loss,
        "final_val_loss": loss_stats(r.final_val_loss for r in results),
        "wall_s": loss_stats(r.wall_s for r in results),
        "train_s": _mean(r.train_s for r in results),
        "comm_s": _mean(r.comm_s for r in results),
        "eval_s": _mean(r.eval_s for r in results),
    }
    if spec.method == "sync":
        summary["wan"] = {
            "simulated": False,
            "allreduce_fp32_bytes_equivalent": spec.total_steps * spec.regions * 2 * model_bytes,
            "note": "not simulated: synchronous training through the coordinator would move "
            "each region's fp32 gradient up and the mean down every step",
        }
    else:
        up, down = _mean(r.bytes_up for r in results), _mean(r.bytes_down for r in results)
        fp32 = _mean(r.fp32_bytes_up + r.fp32_bytes_down for r in results)
        per_round_region = spec.rounds * spec.regions
        summary["scheme"] = spec.scheme
        summary["outer"] = spec.outer.model_dump()
        summary["overlap"] = spec.overlap
        summary["arrival_fraction"] = spec.arrival_fraction if spec.overlap != "none" else None
        if spec.fragments is not None:
            summary["fragments"] = spec.fragments
            summary["tensor_synced_every_steps"] = spec.fragments * spec.inner_steps
        summary["wan"] = {
            "simulated": True,
            "bytes_up": up,
            "bytes_down": down,
            "fp32_bytes_equivalent": fp32,
            "bytes_per_round_per_region": (up + down) / per_round_region,
            "fp32_bytes_per_round_per_region": fp32 / per_round_region,
            "ratio": (up + down) / fp32,
            "delta_ratio": up / _mean(r.fp32_bytes_up for r in results),
            "update_ratio": down / _mean(r.fp32_bytes_down for r in results),
            "worst_round_region_ratio": max(r.max_round_region_ratio for r in results),
            "worst_stream_ratio": max(max(r.max_delta_ratio, r.max_update_ratio) for r in results),
        }
    summary["runs"] = [_run_record(r) for r in results]
    return summary


def compare(runs: dict[str, list[RunResult]], name: str, reference: str) -> dict[str, Any]:
    """Paired (same seed) difference of final validation loss, against the seed spread.

    The spread is the larger of the two configurations' ranges (max - min) over seeds; a
    mean difference smaller than it is not resolved by this many seeds.
    """
    pairs = [
        (a.final_val_loss, b.final_val_loss)
        for a, b in zip(runs[name], runs[reference], strict=True)
    ]
    difference = _mean(a - b for a, b in pairs)
    spread = None
    if len(pairs) > 1:
        spread = max(
            max(values) - min(values) for values in ([a for a, _ in pairs], [b for _, b in pairs])
        )
    return {
        "config": name,
        "reference": reference,
        "mean_difference": difference,
        "mean_relative_difference": _mean((a - b) / b for a, b in pairs),
        "per_seed_relative_difference": [(a - b) / b for a, b in pairs],
        "seed_spread": spread,
        "within_seed_spread": None if spread is None else abs(difference) < spread,
    }


def _spread_text(comparison: dict[str, Any]) -> str:
    if comparison["within_seed_spread"] is None:
        return "one seed: spread unknown"
    relation = "smaller" if comparison["within_seed_spread"] else "larger"
    return (
        f"difference {comparison['mean_difference']:+.4f} is {relation} than the seed "
        f"spread {comparison['seed_spread']:.4f}"
    )


def targets(configs: dict[str, Any], runs: dict[str, list[RunResult]]) -> list[dict[str, Any]]:
    """Check DESIGN's targets; ``met`` is None where DESIGN asks only for a report."""
    checks: list[dict[str, Any]] = []
    for scheme, bound in (("int8", 1 / 4), ("int4", 1 / 8)):
        wan = configs[f"diloco_{scheme}"]["wan"]
        checks.append(
            {
                "name": f"{scheme} WAN bytes per round per region <= 1/{round(1 / bound)} of fp32",
                "measured": f"worst round and region {wan['worst_round_region_ratio']:.4f} "
                f"of fp32; over the run {wan['ratio']:.4f} (delta {wan['delta_ratio']:.4f}, "
                f"update {wan['update_ratio']:.4f}; worst single stream "
                f"{wan['worst_stream_ratio']:.4f})",
                "value": wan["worst_round_region_ratio"],
                "met": wan["worst_round_region_ratio"] <= bound,
            }
        )
    for scheme, bound in (("int8", 0.01), ("int4", 0.02)):
        comparison = compare(runs, f"diloco_{scheme}", "diloco_fp32")
        checks.append(
            {
                "name": f"{scheme} final loss within {bound:.0%} of DiLoCo fp32",
                "measured": f"{comparison['mean_relative_difference']:+.2%} "
                f"({_spread_text(comparison)})",
                "value": comparison["mean_relative_difference"],
                "met": comparison["mean_relative_difference"] <= bound,
                "comparison": comparison,
            }
        )
    for name in OVERLAP_CONFIGS:
        if name not in runs:
            continue
        comparison = compare(runs, name, "diloco_fp32")
        fraction = runs[name][0].spec.arrival_fraction
        checks.append(
            {
                "name": f"overlap delayed (θ arrives after {fraction:.0%} of the next inner "
                "phase) final loss within 1% of overlap none",
                "measured": f"{comparison['mean_relative_difference']:+.2%} "
                f"({_spread_text(comparison)})",
                "value": comparison["mean_relative_difference"],
                "met": comparison["mean_relative_difference"] <= 0.01,
                "comparison": comparison,
            }
        )
    for name in STREAMING_CONFIGS:
        if name not in runs:
            continue
        spec = runs[name][0].spec
        what = (
            f"overlap streaming (F={spec.fragments}, rounds of {spec.inner_steps} steps, each "
            f"tensor synced every {(spec.fragments or 1) * spec.inner_steps} steps, θ arrives "
            f"after {spec.arrival_fraction:.0%} of the next inner phase)"
        )
        for reference, label in (
            ("diloco_fp32", "overlap none"),
            ("delayed_end", "overlap delayed (rounds of H steps, θ at the end of the phase)"),
        ):
            if reference not in runs:
                continue
            comparison = compare(runs, name, reference)
            checks.append(
                {
                    "name": f"{what} final loss vs {label} at equal tokens (reported)",
                    "measured": f"{comparison['mean_relative_difference']:+.2%} "
                    f"({_spread_text(comparison)})",
                    "value": comparison["mean_relative_difference"],
                    "met": None,
                    "comparison": comparison,
                }
            )
        peak = configs[name]["wan"]["bytes_per_round_per_region"]
        whole = configs["diloco_fp32"]["wan"]["bytes_per_round_per_region"]
        checks.append(
            {
                "name": f"{what} WAN bytes per round per region vs overlap none (reported)",
                "measured": f"{peak / whole:.4f} of overlap none's ({peak:,.0f} vs {whole:,.0f}; "
                f"1/F = {1 / (spec.fragments or 1):.4f})",
                "value": peak / whole,
                "met": None,
            }
        )
    comparison = compare(runs, "diloco_fp32", "fedavg")
    checks.append(
        {
            "name": "DiLoCo fp32 at least as good as plain averaging",
            "measured": f"{comparison['mean_relative_difference']:+.2%} vs plain averaging "
            f"({_spread_text(comparison)})",
            "value": comparison["mean_relative_difference"],
            "met": comparison["mean_difference"] <= 0.0,
            "comparison": comparison,
        }
    )
    for scheme in ("fp32", "int8", "int4"):
        comparison = compare(runs, f"diloco_{scheme}", "sync")
        checks.append(
            {
                "name": f"gap DiLoCo {scheme} vs synchronous baseline at equal tokens (reported)",
                "measured": f"{comparison['mean_relative_difference']:+.2%} "
                f"({_spread_text(comparison)})",
                "value": comparison["mean_relative_difference"],
                "met": None,
                "comparison": comparison,
            }
        )
    return checks


def curve_table(runs: dict[str, list[RunResult]]) -> list[dict[str, Any]]:
    """Mean validation loss over seeds at each step the first configuration was evaluated.

    A configuration evaluated on another grid (rounds of another length) shows its last
    evaluation at or before the step; ``evaluated_at`` then names the step it was taken at.
    """
    by_config: dict[str, dict[int, tuple[int, list[float]]]] = {
        name: {p.step: (p.tokens, []) for p in results[0].curve} for name, results in runs.items()
    }
    for name, results in runs.items():
        for result in results:
            for point in result.curve:
                by_config[name][point.step][1].append(point.val_loss)
    first = next(iter(by_config.values()))
    rows: list[dict[str, Any]] = []
    for step in sorted(first):
        row: dict[str, Any] = {"step": step, "tokens": first[step][0]}
        earlier: dict[str, int] = {}
        for name, points in by_config.items():
            at = max(s for s in points if s <= step)
            row[name] = _mean(points[at][1])
            if at != step:
                earlier[name] = at
        if earlier:
            row["evaluated_at"] = earlier
        rows.append(row)
    return rows


def run_outer_sweep(task: CharLMTask, settings: Settings) -> dict[str, list[RunResult]]:
    """Every outer configuration on the choice seed, then the best (lowest final loss),
    plain averaging and the DiLoCo paper's setting on each confirming seed.

    Runs are keyed ``name`` (choice seed) and ``confirm/name`` (confirming seeds).
    """
    base = replace(
        _spec(settings, "outer", settings.inner_steps, settings.rounds),
        method="diloco",
        scheme="fp32",
        seed=settings.choice_seed,
    )
    warm_up(task, base)
    results: dict[str, list[RunResult]] = {}
    configs = sweep_outer_configs(settings)
    for name, config in configs.items():
        results[name] = [_run(task, replace(base, name=name, outer=config))]
    best = min(configs, key=lambda name: results[name][0].final_val_loss)
    confirm = {"chosen": configs[best], "plain_averaging": PLAIN_AVERAGING}
    confirm["diloco_paper"] = DILOCO_PAPER
    for seed in settings.confirm_seeds:
        for name, config in confirm.items():
            spec = replace(base, name=f"confirm/{name}", outer=config, seed=seed)
            results.setdefault(f"confirm/{name}", []).append(_run(task, spec))
    return results


def outer_sweep_figures(settings: Settings, runs: dict[str, list[RunResult]]) -> dict[str, Any]:
    """The sweep's rows (vs plain averaging on the choice seed), the choice and its check."""
    configs = sweep_outer_configs(settings)
    reference = runs["lr1_m0_w0"][0]
    rows: list[dict[str, Any]] = []
    for name, config in configs.items():
        loss = runs[name][0].final_val_loss
        rows.append(
            {
                "config": name,
                "outer": config.model_dump(),
                "final_val_loss": loss,
                "vs_plain_averaging": (loss - reference.final_val_loss) / reference.final_val_loss,
            }
        )
    best = min(rows, key=lambda row: float(row["final_val_loss"]))
    confirmation: dict[str, dict[str, Any]] = {
        name: {
            "outer": runs[f"confirm/{name}"][0].spec.outer.model_dump(),
            "final_val_loss": loss_stats(r.final_val_loss for r in runs[f"confirm/{name}"]),
            "per_seed": [r.final_val_loss for r in runs[f"confirm/{name}"]],
            "vs_plain_averaging": compare(runs, f"confirm/{name}", "confirm/plain_averaging"),
        }
        for name in ("chosen", "plain_averaging", "diloco_paper")
    }
    chosen = confirmation["chosen"]["vs_plain_averaging"]
    return {
        "choice_seed": settings.choice_seed,
        "confirm_seeds": list(settings.confirm_seeds),
        "rows": rows,
        "chosen": best,
        "confirmation": confirmation,
        "chosen_at_least_as_good_as_plain_averaging": all(
            d <= 0.0 for d in chosen["per_seed_relative_difference"]
        ),
    }


# -- overlap sweep -------------------------------------------------------------------

#: The fold as the agent does it today: start from y_r, keep all progress since S.
TODAY_FOLD: tuple[DelayedStart, float] = ("local", 1.0)


def fold_name(start: str, mix: float) -> str:
    return f"{start}_mix{mix:g}"


def overlap_folds(settings: Settings) -> dict[str, tuple[DelayedStart, float]]:
    """The fold candidates: each mix from the local start, then each other start at a = 1."""
    folds: dict[str, tuple[DelayedStart, float]] = {fold_name(*TODAY_FOLD): TODAY_FOLD}
    for mix in settings.sweep_mix:
        folds[fold_name("local", mix)] = ("local", mix)
    for start in settings.sweep_start:
        folds[fold_name(start, 1.0)] = (start, 1.0)
    return folds


def overlap_outer_configs(settings: Settings) -> dict[str, OuterOptimizerConfig]:
    """Outer configs tried on the best fold: lr x momentum (warm-up only with momentum)."""
    configs: dict[str, OuterOptimizerConfig] = {"defaults": OuterOptimizerConfig()}
    for lr in settings.sweep_lr:
        for momentum in settings.sweep_momentum:
            for warmup in sorted({w if momentum else 0 for w in settings.sweep_warmup}):
                config = OuterOptimizerConfig(
                    lr=lr, momentum=momentum, momentum_warmup_rounds=warmup
                )
                if config != configs["defaults"]:
                    configs[f"lr{lr:g}_m{momentum:g}_w{warmup}"] = config
    return configs


def _delayed_key(fold: str, outer: str, arrival: float) -> str:
    return f"{fold}/{outer}/a{arrival:g}"


def _mean_gap(
    runs: dict[str, list[RunResult]], fold: str, outer: str, arrivals: Iterable[float]
) -> float:
    """Mean over arrivals of the relative final-loss gap to ``none`` (choice seed)."""
    none = runs["none"][0].final_val_loss
    return _mean(
        (runs[_delayed_key(fold, outer, a)][0].final_val_loss - none) / none for a in arrivals
    )


def run_overlap_sweep(task: CharLMTask, settings: Settings) -> dict[str, list[RunResult]]:
    """On the choice seed: ``none``, every fold at every arrival with the default outer
    optimizer, then every outer config with the best fold; the lowest mean gap over the
    arrivals is chosen. On the confirming seeds: ``none``, today's fold and the choice.

    Runs are keyed ``none``, ``fold/outer/aF`` and ``confirm/...`` for the confirming seeds.
    """
    base = replace(
        _spec(settings, "overlap", settings.inner_steps, settings.rounds),
        method="diloco",
        scheme="fp32",
        seed=settings.choice_seed,
    )
    warm_up(task, base)
    folds = overlap_folds(settings)
    configs = overlap_outer_configs(settings)

    def delayed(fold: str, outer: str, arrival: float, seed: int, prefix: str = "") -> RunSpec:
        start, mix = folds[fold]
        return replace(
            base,
            name=prefix + _delayed_key(fold, outer, arrival),
            seed=seed,
            overlap="delayed",
            arrival_fraction=arrival,
            delayed_start=start,
            fold_mix=mix,
            outer=configs[outer],
        )

    results: dict[str, list[RunResult]] = {"none": [_run(task, replace(base, name="none"))]}
    for fold in folds:
        for arrival in settings.arrivals:
            spec = delayed(fold, "defaults", arrival, settings.choice_seed)
            results[spec.name] = [_run(task, spec)]
    best_fold = min(folds, key=lambda f: _mean_gap(results, f, "defaults", settings.arrivals))
    for outer in configs:
        if outer == "defaults":
            continue
        for arrival in settings.arrivals:
            spec = delayed(best_fold, outer, arrival, settings.choice_seed)
            results[spec.name] = [_run(task, spec)]
    chosen = _overlap_choice(settings, results)
    for seed in settings.confirm_seeds:
        spec = replace(base, name="confirm/none", seed=seed)
        results.setdefault(spec.name, []).append(_run(task, spec))
        for fold, outer in dict.fromkeys([(fold_name(*TODAY_FOLD), "defaults"), chosen]):
            for arrival in settings.arrivals:
                spec = delayed(fold, outer, arrival, seed, prefix="confirm/")
                results.setdefault(spec.name, []).append(_run(task, spec))
    return results


def _overlap_choice(settings: Settings, runs: dict[str, list[RunResult]]) -> tuple[str, str]:
    """(fold, outer) with the lowest mean gap to ``none`` over the arrivals, choice seed."""
    tried = {
        tuple(name.split("/")[:2])
        for name in runs
        if name.count("/") == 2 and not name.startswith("confirm/")
    }
    return min(  # type: ignore[return-value]
        sorted(tried), key=lambda pair: _mean_gap(runs, pair[0], pair[1], settings.arrivals)
    )


def overlap_sweep_figures(settings: Settings, runs: dict[str, list[RunResult]]) -> dict[str, Any]:
    """Rows of the choice seed (gap to ``none`` per arrival), the choice and its check."""
    folds = overlap_folds(settings)
    configs = overlap_outer_configs(settings)
    none = runs["none"][0].final_val_loss
    rows: list[dict[str, Any]] = []
    for fold, outer in sorted(
        {tuple(n.split("/")[:2]) for n in runs if n.count("/") == 2 and "confirm" not in n}
    ):
        start, mix = folds[fold]
        per_arrival = {}
        for arrival in settings.arrivals:
            loss = runs[_delayed_key(fold, outer, arrival)][0].final_val_loss
            per_arrival[f"{arrival:g}"] = {"final_val_loss": loss, "vs_none": (loss - none) / none}
        rows.append(
            {
                "fold": fold,
                "start": start,
                "fold_mix": mix,
                "outer_name": outer,
                "outer": configs[outer].model_dump(),
                "by_arrival": per_arrival,
                "mean_vs_none": _mean_gap(runs, fold, outer, settings.arrivals),
            }
        )
    chosen_fold, chosen_outer = _overlap_choice(settings, runs)
    today = fold_name(*TODAY_FOLD)
    confirmation: dict[str, Any] = {
        "none": {
            "final_val_loss": loss_stats(r.final_val_loss for r in runs["confirm/none"]),
            "per_seed": [r.final_val_loss for r in runs["confirm/none"]],
        }
    }
    checks: list[dict[str, Any]] = []
    for label, (fold, outer) in (
        ("today", (today, "defaults")),
        ("chosen", (chosen_fold, chosen_outer)),
    ):
        for arrival in settings.arrivals:
            name = "confirm/" + _delayed_key(fold, outer, arrival)
            comparison = compare(runs, name, "confirm/none")
            confirmation[f"{label}/a{arrival:g}"] = {
                "fold": fold,
                "outer": configs[outer].model_dump(),
                "arrival_fraction": arrival,
                "final_val_loss": loss_stats(r.final_val_loss for r in runs[name]),
                "per_seed": [r.final_val_loss for r in runs[name]],
                "vs_none": comparison,
            }
            if label == "chosen":
                checks.append(
                    {
                        "name": f"overlap delayed (θ arrives after {arrival:.0%} of the next "
                        "inner phase), chosen correction, final loss within 1% of overlap "
                        f"none (seeds {list(settings.confirm_seeds)})",
                        "measured": f"{comparison['mean_relative_difference']:+.2%} "
                        f"({_spread_text(comparison)})",
                        "value": comparison["mean_relative_difference"],
                        "met": comparison["mean_relative_difference"] <= 0.01,
                    }
                )
    return {
        "choice_seed": settings.choice_seed,
        "confirm_seeds": list(settings.confirm_seeds),
        "arrivals": list(settings.arrivals),
        "none_final_val_loss": none,
        "rows": rows,
        "chosen": {
            "fold": chosen_fold,
            "outer_name": chosen_outer,
            **dict(zip(("start", "fold_mix"), folds[chosen_fold], strict=True)),
            "outer": configs[chosen_outer].model_dump(),
        },
        "confirmation": confirmation,
        "targets": checks,
    }


def _fold_cell(start: str, mix: float) -> str:
    what = {"local": "from y_r", "global": "from θ_r", "eager": "eager start"}[start]
    return f"{what}, a = {mix:g}"


def render_overlap_sweep(report: dict[str, Any]) -> str:
    lines = _header(report, "Overlap delayed: corrections of the late fold")
    sweep = report["overlap_sweep"]
    arrivals = sweep["arrivals"]
    lines += [
        "DiLoCo fp32. A delayed region trains round r+1 from a start S until θ_(r+1) "
        "arrives after a fraction of the inner phase, then folds y ← θ_(r+1) + a·(y - S). "
        "Start `from y_r` is today's rule (its own parameters when it sent Δ_r); `from θ_r` "
        "is the last global parameters it has; `eager start` is θ_r plus an outer step on "
        "ĝ = ḡ_(r-1) + (Δ_r - Δ_(r-1))/M (its fresh delta in place of its previous one in "
        "the previous mean, which it recovers from θ_r - θ_(r-1) and the outer config). "
        f"Every fold runs on seed {sweep['choice_seed']} with the default outer optimizer; "
        "the outer configs then run with the best fold; the lowest mean gap to `none` over "
        f"the arrivals is chosen and confirmed on seeds {sweep['confirm_seeds']}, which took "
        "no part in the choice. All runs see the same tokens.",
        "",
        f"## Sweep (seed {sweep['choice_seed']}; `none`: {sweep['none_final_val_loss']:.4f})",
        "",
        "| fold | outer optimizer | "
        + " | ".join(f"θ after {a:.0%}: loss (vs none)" for a in arrivals)
        + " | mean vs none |",
        "|---|---|" + "---|" * len(arrivals) + "---|",
    ]
    for row in sorted(sweep["rows"], key=lambda r: r["mean_vs_none"]):
        cells = " | ".join(
            f"{row['by_arrival'][f'{a:g}']['final_val_loss']:.4f} "
            f"({row['by_arrival'][f'{a:g}']['vs_none']:+.2%})"
            for a in arrivals
        )
        lines.append(
            f"| {_fold_cell(row['start'], row['fold_mix'])} | {_outer_cell(row['outer'])} | "
            f"{cells} | {row['mean_vs_none']:+.2%} |"
        )
    chosen = sweep["chosen"]
    lines += [
        "",
        f"Chosen: {_fold_cell(chosen['start'], chosen['fold_mix'])}, "
        f"{_outer_cell(chosen['outer'])}.",
        "",
        f"## Confirmation (seeds {sweep['confirm_seeds']})",
        "",
        "| config | θ arrives after | final val loss (mean ± std) | per seed | vs none "
        "(mean; per seed) |",
        "|---|---|---|---|---|",
    ]
    none = sweep["confirmation"]["none"]
    per_seed = ", ".join(f"{x:.4f}" for x in none["per_seed"])
    lines.append(f"| overlap none | | {_loss_cell(none['final_val_loss'])} | {per_seed} | |")
    for name, row in sweep["confirmation"].items():
        if name == "none":
            continue
        vs = row["vs_none"]
        label = "today" if name.startswith("today") else "chosen"
        start, mix = overlap_folds_from(row["fold"])
        per_seed = ", ".join(f"{x:.4f}" for x in row["per_seed"])
        rel = ", ".join(f"{x:+.2%}" for x in vs["per_seed_relative_difference"])
        lines.append(
            f"| {label}: {_fold_cell(start, mix)}, {_outer_cell(row['outer'])} | "
            f"{row['arrival_fraction']:.0%} | {_loss_cell(row['final_val_loss'])} | "
            f"{per_seed} | {vs['mean_relative_difference']:+.2%}; {rel} |"
        )
    lines += targets_table(sweep["targets"])
    return "\n".join(lines) + "\n"


def overlap_folds_from(name: str) -> tuple[str, float]:
    """(start, mix) back from :func:`fold_name`."""
    start, mix = name.split("_mix")
    return start, float(mix)


def sweep_rows(runs: dict[str, list[RunResult]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name, results in runs.items():
        if name == "sync":
            continue
        spec = results[0].spec
        rows.append(
            {
                "config": name,
                "inner_steps": spec.inner_steps,
                "warm_start_steps": spec.warmup_steps,
                "rounds": spec.rounds,
                "final_val_loss": loss_stats(r.final_val_loss for r in results),
                "vs_sync": compare(runs, name, "sync"),
            }
        )
    return rows


# -- markdown ------------------------------------------------------------------------


def _loss_cell(stats: dict[str, Any]) -> str:
    return f"{stats['mean']:.4f} ± {stats['std']:.4f} (n={stats['n']})"


def _header(report: dict[str, Any], title: str) -> list[str]:
    s = report["settings"]
    lines = [
        f"# {title}",
        "",
        f"Machine: {machine_line(report['machine'])}.",
    ]
    if report["note"]:
        lines.append(f"Note: {report['note']}")
    lines += [
        "",
        f"Task: charlm ({s['model_parameters']:,} parameters), {s['regions']} regions x "
        f"{s['workers_per_region']} workers, {s['total_steps']} steps per run "
        f"(equal tokens for every configuration), seeds {s['seeds']}, "
        f"{s['torch_threads']} torch thread(s). Total wall time {report['total_wall_s']:.0f} s.",
        "",
        *(f"> {note}" for note in report["notes"]),
        "",
    ]
    return lines


def render_main(report: dict[str, Any]) -> str:
    lines = _header(report, "Convergence at equal tokens")
    configs = report["configs"]
    lines += [
        "DiLoCo rows use the outer optimizer's defaults: "
        f"{_outer_cell(report['settings']['outer_optimizer'])} (see outer_sweep.md).",
        "",
        "`vs none` (overlap rows): the relative difference of final loss to the DiLoCo fp32 "
        "row (overlap none), mean over seeds, and per seed.",
        "",
        "| config | final val loss (mean ± std) | vs sync | vs none | WAN bytes up+down "
        "| per round per region | fp32 equivalent | ratio | wall s (train / comm / eval) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in configs.values():
        vs_sync = c.get("vs_sync")
        vs_none = c.get("vs_none")
        wan = c["wan"]
        if wan["simulated"]:
            moved = f"{wan['bytes_up'] + wan['bytes_down']:,.0f}"
            per_round = f"{wan['bytes_per_round_per_region']:,.0f}"
            fp32 = f"{wan['fp32_bytes_equivalent']:,.0f}"
            ratio = f"{wan['ratio']:.4f}"
        else:
            moved, per_round, fp32, ratio = (
                "(not simulated)",
                "",
                f"{wan['allreduce_fp32_bytes_equivalent']:,}",
                "",
            )
        none_cell = ""
        if vs_none:
            per_seed = ", ".join(f"{x:+.2%}" for x in vs_none["per_seed_relative_difference"])
            none_cell = f"{vs_none['mean_relative_difference']:+.2%} ({per_seed})"
        lines.append(
            f"| {c['label']} | {_loss_cell(c['final_val_loss'])} | "
            + (f"{vs_sync['mean_relative_difference']:+.2%}" if vs_sync else "")
            + f" | {none_cell} | {moved} | {per_round} | {fp32} | {ratio} | "
            f"{c['wall_s']['mean']:.0f} "
            f"({c['train_s']:.0f} / {c['comm_s']:.1f} / {c['eval_s']:.1f}) |"
        )
    lines += targets_table(report["targets"])
    names = list(configs)
    lines += [
        "",
        "## Validation loss by training length (mean over seeds)",
        "",
        "A value evaluated at an earlier step (rounds of another length) says at which.",
        "",
        "| step | tokens | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for row in report["curve"]:
        earlier = row.get("evaluated_at", {})
        cells = " | ".join(
            f"{row[name]:.4f}" + (f" (at {earlier[name]})" if name in earlier else "")
            for name in names
        )
        lines.append(f"| {row['step']} | {row['tokens']:,} | {cells} |")
    return "\n".join(lines) + "\n"


def render_robust(report: dict[str, Any]) -> str:
    lines = _header(report, "Robust aggregation: cost with honest regions, savings under attack")
    factors = ", ".join(f"{a}: x{ATTACK_FACTORS[a]:g}" for a in ATTACKS if a != "none")
    lines += [
        f"DiLoCo fp32 with the outer optimizer's defaults. Under attack the last of the "
        f"{report['settings']['regions']} regions trains honestly and sends its delta "
        f"multiplied ({factors}), claiming its honest tokens. Each cell: final validation "
        "loss, and its relative difference to the mean with honest regions (same seed).",
        "",
        "| rule | honest | scaled | sign-flipped |",
        "|---|---|---|---|",
    ]
    for row in report["robust"]:
        cells = []
        for attack in ATTACKS:
            cell = row[attack]
            relative = cell["vs_honest_mean"]["mean_relative_difference"]
            cells.append(f"{cell['final_val_loss']['mean']:.4f} ({relative:+.2%})")
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _outer_cell(outer: dict[str, Any]) -> str:
    if outer["kind"] == "average":
        return "plain averaging (lr 1, momentum 0)"
    text = f"lr {outer['lr']:g}, momentum {outer['momentum']:g}"
    if outer["momentum_warmup_rounds"]:
        text += f", warm-up {outer['momentum_warmup_rounds']} rounds"
    return text


def render_outer_sweep(report: dict[str, Any]) -> str:
    lines = _header(report, "Outer optimizer: lr, momentum and momentum warm-up")
    sweep = report["outer_sweep"]
    lines += [
        f"DiLoCo fp32 (Nesterov outer SGD). The sweep runs on seed {sweep['choice_seed']}; "
        "the lowest final loss is chosen, then it, plain averaging and the DiLoCo paper's "
        f"setting (lr 0.7, momentum 0.9) run on seeds {sweep['confirm_seeds']}, which took "
        "no part in the choice. A momentum warm-up of k rounds ramps μ linearly from 0 at "
        "the first outer step to its value at step k+1.",
        "",
        f"## Sweep (seed {sweep['choice_seed']})",
        "",
        "| outer optimizer | final val loss | vs plain averaging |",
        "|---|---|---|",
    ]
    for row in sorted(sweep["rows"], key=lambda r: r["final_val_loss"]):
        lines.append(
            f"| {_outer_cell(row['outer'])} | {row['final_val_loss']:.4f} | "
            f"{row['vs_plain_averaging']:+.2%} |"
        )
    lines += [
        "",
        f"Chosen: {_outer_cell(sweep['chosen']['outer'])}.",
        "",
        f"## Confirmation (seeds {sweep['confirm_seeds']})",
        "",
        "| outer optimizer | final val loss (mean ± std) | per seed | vs plain averaging "
        "(mean; per seed) |",
        "|---|---|---|---|",
    ]
    for name, row in sweep["confirmation"].items():
        vs = row["vs_plain_averaging"]
        per_seed = ", ".join(f"{x:.4f}" for x in row["per_seed"])
        rel = ", ".join(f"{x:+.2%}" for x in vs["per_seed_relative_difference"])
        label = _outer_cell(row["outer"])
        if name != "plain_averaging":
            label = f"{name.replace('_', ' ')}: {label}"
        lines.append(
            f"| {label} | "
            f"{_loss_cell(row['final_val_loss'])} | {per_seed} | "
            f"{vs['mean_relative_difference']:+.2%}; {rel} |"
        )
    verdict = "yes" if sweep["chosen_at_least_as_good_as_plain_averaging"] else "NO"
    lines += [
        "",
        f"Chosen at least as good as plain averaging on every confirming seed: {verdict}.",
    ]
    return "\n".join(lines) + "\n"


def render_sweep(report: dict[str, Any]) -> str:
    lines = _header(report, "DiLoCo vs synchronous training: inner steps H and warm start")
    sync = report["configs"]["sync"]
    lines += [
        f"Synchronous baseline: {_loss_cell(sync['final_val_loss'])}. DiLoCo fp32 with the "
        "outer optimizer's defaults; a warm start trains its first steps synchronously.",
        "",
        "| H | warm-start steps | rounds | final val loss | vs sync | seed spread |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["sweep"]:
        vs = row["vs_sync"]
        spread = "n/a" if vs["seed_spread"] is None else f"{vs['seed_spread']:.4f}"
        lines.append(
            f"| {row['inner_steps']} | {row['warm_start_steps']} | {row['rounds']} | "
            f"{_loss_cell(row['final_val_loss'])} | {vs['mean_relative_difference']:+.2%} | "
            f"{spread} |"
        )
    return "\n".join(lines) + "\n"


def build_report(
    settings: Settings, task: CharLMTask, runs: dict[str, list[RunResult]]
) -> dict[str, Any]:
    model = task.build_model()
    params = sum(p.numel() for p in model.parameters())
    labels = {name: label for name, (label, _) in main_configs(settings).items()}
    report: dict[str, Any] = {
        "benchmark": "convergence_sweep"
        if settings.sweep
        else "robust_aggregation"
        if settings.robust
        else "outer_sweep"
        if settings.outer_sweep
        else "overlap_sweep"
        if settings.overlap_sweep
        else "convergence",
        "machine": describe_machine(),
        "note": settings.note,
        "settings": {
            "task": "geofed.examples.charlm:CharLMTask",
            "task_options": task.options.model_dump(mode="json"),
            "model_parameters": params,
            "regions": settings.regions,
            "workers_per_region": settings.workers,
            "rounds": settings.rounds,
            "inner_steps": settings.inner_steps,
            "total_steps": settings.rounds * settings.inner_steps,
            "seeds": [settings.choice_seed, *settings.confirm_seeds]
            if settings.outer_sweep or settings.overlap_sweep
            else list(range(settings.seeds)),
            "torch_threads": settings.threads,
            "fragments": settings.fragments,
            "smoke": settings.smoke,
            "outer_optimizer": OuterOptimizerConfig().model_dump(),
            "codec": "geofed.codec defaults (block 128, bf16 scales, zstd level 1), "
            "error feedback on both sides",
        },
        "notes": [SIMULATION_NOTE]
        + (
            []
            if settings.robust or settings.sweep or settings.outer_sweep or settings.overlap_sweep
            else [OVERLAP_NOTE]
        ),
        "configs": {
            name: config_summary(labels.get(name, name), results, 4 * params)
            for name, results in runs.items()
        },
    }
    if settings.robust:
        report["settings"]["attack_factors"] = dict(ATTACK_FACTORS)
        report["robust"] = robust_rows(runs)
        return report
    if settings.outer_sweep:
        report["outer_sweep"] = outer_sweep_figures(settings, runs)
        return report
    if settings.overlap_sweep:
        report["overlap_sweep"] = overlap_sweep_figures(settings, runs)
        return report
    for name, summary in report["configs"].items():
        if name != "sync":
            summary["vs_sync"] = compare(runs, name, "sync")
        if summary.get("overlap") in ("delayed", "streaming") and "diloco_fp32" in runs:
            summary["vs_none"] = compare(runs, name, "diloco_fp32")
    if settings.sweep:
        report["settings"]["sweep_h"] = list(settings.sweep_h)
        report["settings"]["warm_start_steps"] = settings.warm_start_steps
        report["sweep"] = sweep_rows(runs)
    else:
        report["targets"] = targets(report["configs"], runs)
        report["curve"] = curve_table(runs)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    torch.set_num_threads(settings.threads)
    options = CharLMOptions.model_validate(settings.task_options)
    task = CharLMTask(options)
    print(f"machine: {machine_line(describe_machine())}", file=sys.stderr)
    started = time.perf_counter()
    try:
        if settings.sweep:
            runs = run_sweep(task, settings)
        elif settings.robust:
            runs = run_robust(task, settings)
        elif settings.outer_sweep:
            runs = run_outer_sweep(task, settings)
        elif settings.overlap_sweep:
            runs = run_overlap_sweep(task, settings)
        else:
            runs = run_main(task, settings)
    except SimulationError as exc:
        print(f"convergence: {exc}", file=sys.stderr)
        return 1
    report = build_report(settings, task, runs)
    report["total_wall_s"] = time.perf_counter() - started
    if settings.sweep:
        markdown = render_sweep(report)
    elif settings.robust:
        markdown = render_robust(report)
    elif settings.outer_sweep:
        markdown = render_outer_sweep(report)
    elif settings.overlap_sweep:
        markdown = render_overlap_sweep(report)
    else:
        markdown = render_main(report)
    publish(report, settings.out, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
