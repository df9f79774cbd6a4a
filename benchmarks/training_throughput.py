"""Training throughput inside a region: geofed's inner loop against plain torch.

    python -m benchmarks.training_throughput [--preset tiny] [--steps 20] [--warmup 3]
        [--repeats 3] [--parallelism ddp,fsdp] [--precision fp32,bf16] [--world-sizes 1,2]
        [--batch-size N] [--seq-len N] [--n-layers N] [--threads N]
        [--peak-flops PRECISION=FLOPS ...] [--smoke] [--out PATH]

For each world size W, W rank processes form a real process group (gloo on CPU, nccl
with one GPU per rank when CUDA is present) and train the Llama example
(:mod:`geofed.examples.llama`, ``--preset``) for every (parallelism, precision) through
the worker's own code: :meth:`regional_agent.worker.job_state.WorkerJobState.build` and ``ready``
(which wrap the model with :func:`regional_agent.worker.parallelism.wrap` and build the task's
optimizer), then :func:`regional_agent.worker.inner_loop.train_round`, whose stop check is the
worker's per-step stop vote (a one-integer all-reduce). A first round of ``--warmup``
steps is not timed; then ``--repeats`` rounds of ``--steps`` steps are.

The baseline is a plain single-process loop on one device, run on rank 0 before each of
those rounds while the other ranks wait: the same task, model, optimizer and batches
(rank 0's), ``zero_grad → loss → backward → step``, under ``torch.autocast`` for bf16,
``--warmup`` untimed steps then ``--steps`` timed, from a fresh model each time (so
the region's peak memory never holds it). Alternating keeps both under the same
conditions on a busy machine; the best run of each is kept.

``ratio`` is the region's tokens/s over the plain loop's tokens/s times W: each rank's
share of the plain loop's speed on the same device (its GPU, or on the CPU its share of
the cores: ``--threads`` split evenly between the ranks, which the plain loop runs with
too, as rank 0). The target is a ratio of at least 0.95. The region's figures are the
worker's own
(:func:`regional_agent.worker.inner_loop.region_stats`: the slowest rank's time, the largest
rank's peak CUDA memory, the time waiting for batches and, under DDP and FSDP, with a
data-parallel collective in flight). MFU is
:func:`regional_agent.handoff.flops.flops_utilisation` of the task's ``flops_per_token``
and the devices' peak: the table of known GPUs by precision
(:func:`regional_agent.handoff.flops.peak_flops`) or ``--peak-flops``; on a CPU without
``--peak-flops`` it is left out, never guessed.

Writes ``benchmarks/results/training_throughput.json`` (with the machine description)
and ``.md``, and prints the markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, cast, get_args

import torch
import torch.distributed as dist

from benchmarks._machine import describe_machine, machine_line, targets_table
from benchmarks._report import publish
from geofed.examples.llama import PRESETS, LlamaOptions
from geofed.fsutil import atomic_write_bytes
from geofed.params import federated_state
from geofed.ports import unused_port
from geofed.task import DataShard, Task
from geofed.training_config import Parallelism, Precision, TrainingConfig
from regional_agent.handoff.flops import flops_utilisation, peak_flops
from regional_agent.handoff.messages import RoundInstruction
from regional_agent.worker.inner_loop import RankTotals, RoundPlan, region_stats, train_round
from regional_agent.worker.job_state import WorkerJobState

RESULTS = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent
CHILD_FLAG = "--child"
LLAMA = "geofed.examples.llama:LlamaTask"
SEED = 3
TARGET_RATIO = 0.95
CHILD_TIMEOUT_S = 3600.0


@dataclass(frozen=True, slots=True)
class Settings:
    """What one run measures (also what every child process is handed)."""

    preset: str
    task_options: dict[str, Any]
    steps: int
    warmup: int
    repeats: int
    parallelisms: tuple[Parallelism, ...]
    precisions: tuple[Precision, ...]
    world_sizes: tuple[int, ...]
    threads: int
    backend: str
    peak_flops: dict[str, float]
    """``--peak-flops`` by precision; other precisions take
    :mod:`regional_agent.handoff.flops`'s."""
    out: Path

    def record(self) -> dict[str, Any]:
        data = asdict(self)
        data["out"] = str(self.out)
        return data


# -- arguments -------------------------------------------------------------------------


def _names(text: str, allowed: tuple[str, ...], flag: str) -> tuple[Any, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in allowed]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{flag}: choose from {', '.join(allowed)}")
    return names


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"world sizes must be >= 1: {text!r}")
    return values


def _peak(text: str) -> tuple[str, float]:
    precision, _, value = text.partition("=")
    try:
        flops = float(value)
    except ValueError:
        flops = 0.0
    if precision not in get_args(Precision) or not flops > 0:
        raise argparse.ArgumentTypeError(f"expected fp32=FLOPS or bf16=FLOPS, got {text!r}")
    return precision, flops


def parse_args(argv: Sequence[str]) -> Settings:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.training_throughput", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs of each, alternating; the best is kept"
    )
    parser.add_argument("--parallelism", default="ddp,fsdp", help="comma list of ddp, fsdp")
    parser.add_argument("--precision", default="fp32,bf16", help="comma list of fp32, bf16")
    parser.add_argument(
        "--world-sizes",
        type=_positive_ints,
        default=None,
        help="ranks per group (default: 1,2 on CPU; 1 and every GPU on CUDA)",
    )
    parser.add_argument("--batch-size", type=int, default=None, help="samples per rank step")
    parser.add_argument("--seq-len", type=int, default=None, help="bytes of context")
    parser.add_argument("--n-layers", type=int, default=None, help="override the preset's")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of a group on the CPU, split evenly between its ranks; the "
        "plain loop runs with one rank's share (default: the usable CPUs)",
    )
    parser.add_argument(
        "--peak-flops",
        type=_peak,
        action="append",
        default=[],
        metavar="PRECISION=FLOPS",
        help="peak FLOP/s of one rank's device for MFU (a GPU, or a rank's share of the CPU "
        "threads; e.g. bf16=989e12); wins over the table of known GPUs",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a seconds-long run of a 2-block model"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "training_throughput.json")
    args = parser.parse_args(argv)
    try:
        parallelisms = _names(args.parallelism, get_args(Parallelism), "--parallelism")
        precisions = _names(args.precision, get_args(Precision), "--precision")
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1, --warmup >= 0")
    cuda = torch.cuda.is_available()
    options: dict[str, Any] = {"preset": args.preset, "val_batches": 1}
    if args.smoke:
        options.update(n_layers=2, seq_len=32, batch_size=2)
        args.steps, args.warmup, args.repeats = min(args.steps, 3), min(args.warmup, 1), 1
    for key in ("batch_size", "seq_len", "n_layers"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    try:
        LlamaOptions.model_validate(options)
    except ValueError as exc:  # pydantic's ValidationError names the option
        parser.error(f"the llama options {options} do not fit: {exc}")
    if args.world_sizes is None:
        gpus = torch.cuda.device_count() if cuda else 0
        args.world_sizes = tuple(sorted({1, gpus})) if cuda else (1, 2)
        if args.smoke:
            args.world_sizes = (2,) if not cuda else (1,)
    if cuda and max(args.world_sizes) > torch.cuda.device_count():
        parser.error(
            f"world size {max(args.world_sizes)} exceeds the {torch.cuda.device_count()} "
            "visible GPUs: NCCL runs one rank per GPU"
        )
    threads = args.threads or len(os.sched_getaffinity(0))
    return Settings(
        preset=args.preset,
        task_options=options,
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        parallelisms=cast(tuple[Parallelism, ...], parallelisms),
        precisions=cast(tuple[Precision, ...], precisions),
        world_sizes=tuple(args.world_sizes),
        threads=threads,
        backend="nccl" if cuda else "gloo",
        peak_flops=dict(args.peak_flops),
        out=args.out,
    )


# -- what a rank process measures ------------------------------------------------------


def _settings_from(data: dict[str, Any]) -> Settings:
    fields = dict(data)
    fields["out"] = Path(fields["out"])
    for key in ("parallelisms", "precisions", "world_sizes"):
        fields[key] = tuple(fields[key])
    return Settings(**fields)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _shard(rank: int, world_size: int) -> DataShard:
    return DataShard(
        region="bench", region_index=0, num_regions=1, rank=rank, world_size=world_size, seed=SEED
    )


def _precision_context(
    precision: str, device: torch.device
) -> contextlib.AbstractContextManager[object]:
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def plain_loop(
    task: Task[Any], precision: str, settings: Settings, device: torch.device
) -> dict[str, float]:
    """Plain torch on one device, from a fresh model: what the region is compared with."""
    model = task.build_model(seed=SEED).to(device)
    optimizer = task.build_optimizer(model.parameters())
    batches = task.batches(_shard(0, 1))
    model.train()
    tokens = 0
    loss = torch.zeros((), device=device)
    started = 0.0
    for step in range(settings.warmup + settings.steps):
        if step == settings.warmup:
            _sync(device)
            started = time.perf_counter()
        batch = next(batches)
        optimizer.zero_grad(set_to_none=True)
        with _precision_context(precision, device):
            loss = task.loss(model, batch)
        loss.backward()
        optimizer.step()
        if step >= settings.warmup:
            tokens += task.tokens(batch)
    final_loss = float(loss.item())  # waits for the device
    seconds = time.perf_counter() - started
    del model, optimizer
    _release(device)
    return {
        "tokens_per_s": tokens / seconds,
        "step_s": seconds / settings.steps,
        "loss": final_loss,
    }


def _instruction(
    settings: Settings, parallelism: str, precision: str, round_: int, steps: int
) -> RoundInstruction:
    training = TrainingConfig.model_validate({"parallelism": parallelism, "precision": precision})
    return RoundInstruction(
        job=f"bench-{parallelism}-{precision}",
        round=round_,
        base_params="/dev/null",  # never read: no base θ is loaded
        inner_steps=steps,
        task=LLAMA,
        task_options=settings.task_options,
        seed=SEED,
        region="bench",
        region_index=0,
        num_regions=1,
        training=training,
    )


def measure(
    settings: Settings,
    parallelism: str,
    precision: str,
    device: torch.device,
    control: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """One configuration: ``repeats`` times the plain loop on rank 0, then a region round.

    Interleaving keeps both under the same conditions on a busy machine; the best run of
    each is kept (the least disturbed). Collectives throughout.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    first = _instruction(settings, parallelism, precision, 0, max(settings.warmup, 1))
    state = WorkerJobState.build(first, device, None)
    flops_per_token = state.task.flops_per_token(state.model)
    parameters = sum(p.numel() for p in state.model.parameters())
    parallel, optimizer = state.ready(device)
    # As a round's θ is: the ranks built the model without storage (meta), rank 0 holds θ_0.
    theta0 = federated_state(state.task.build_model(seed=first.seed)) if rank == 0 else None
    parallel.load_full_state(theta0)
    del theta0
    batches = state.task.batches(_shard(rank, world))
    rounds = settings.repeats + (1 if settings.warmup else 0)
    total_steps = settings.warmup + settings.repeats * settings.steps

    def should_stop(step: int) -> bool:
        # The worker's stop vote: one integer all-reduced before every step.
        vote = torch.zeros(1, dtype=torch.int32)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=control)
        return bool(vote.item())

    def train(round_: int, steps: int) -> RankTotals:
        plan = RoundPlan(round_, steps, total_steps, state.training)
        totals = train_round(parallel, optimizer, state.task, batches, plan, should_stop, device)
        if totals is None:
            raise RuntimeError("train_round stopped although no rank voted to stop")
        return totals

    if settings.warmup:
        train(0, settings.warmup)
    plain: list[dict[str, float]] = []
    region: list[dict[str, Any]] = []
    for round_ in range(rounds - settings.repeats, rounds):
        dist.barrier(group=control)
        if rank == 0:  # on its own device (its GPU, or its share of the cores); the
            # other ranks wait, idle, in the barrier
            plain.append(plain_loop(state.task, precision, settings, device))
        dist.barrier(group=control)
        totals = train(round_, settings.steps)
        figures = torch.tensor(
            [float(totals.tokens), totals.loss_sum / totals.micro_batches], dtype=torch.float64
        )
        dist.all_reduce(figures, group=control)
        tokens = int(figures[0].item())
        stats = region_stats(totals, tokens, settings.steps, flops_per_token, device, control)
        region.append(
            {
                "tokens_per_s": stats.tokens_per_second,
                "step_s": stats.step_seconds,
                "data_wait_s": stats.data_wait_seconds,
                "comm_s": stats.comm_seconds,
                "peak_memory_bytes": stats.peak_memory_bytes,
                "loss": float(figures[1].item()) / world,
            }
        )
    best = max(region, key=lambda run: float(run["tokens_per_s"]))
    best_plain = max(plain, key=lambda run: run["tokens_per_s"]) if plain else {}
    return {
        "parallelism": parallelism,
        "precision": precision,
        "world_size": world,
        **best,
        "tokens_per_s_runs": [run["tokens_per_s"] for run in region],
        "plain_tokens_per_s": best_plain.get("tokens_per_s"),
        "plain_step_s": best_plain.get("step_s"),
        "plain_tokens_per_s_runs": [run["tokens_per_s"] for run in plain],
        "flops_per_token": flops_per_token,
        "parameters": parameters,
    }


def run_rank(settings: Settings, out: Path) -> int:
    """One rank of a group: every configuration in turn; rank 0 writes the figures."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if settings.backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, settings.threads // world))
    dist.init_process_group(
        settings.backend,
        timeout=timedelta(seconds=600),
        device_id=device if device.type == "cuda" else None,
    )
    # As the worker: control votes over gloo on the CPU, never on the GPU's stream.
    control = dist.new_group(backend="gloo") if device.type == "cuda" else None
    results = []
    for parallelism in settings.parallelisms:
        for precision in settings.precisions:
            results.append(measure(settings, parallelism, precision, device, control))
            _release(device)  # the configuration's model and optimizer are garbage now
            dist.barrier(group=control)
    dist.destroy_process_group()
    if rank == 0:
        atomic_write_bytes(out, json.dumps(results).encode())
    return 0


def run_child(args: list[str]) -> int:
    settings_path, out = args
    return run_rank(_settings_from(json.loads(Path(settings_path).read_text())), Path(out))


# -- the parent: groups, figures, report --------------------------------------------------


def _group(settings: Settings, world: int, work: Path) -> list[dict[str, Any]]:
    """Run a group of ``world`` rank processes through every configuration."""
    settings_path = work / "settings.json"
    settings_path.write_text(json.dumps(settings.record()))
    out = work / f"group-{world}.json"
    command = [sys.executable, "-m", "benchmarks.training_throughput", CHILD_FLAG]
    port = str(unused_port())
    procs = []
    try:
        for rank in range(world):
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])
            )
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            )
            procs.append(
                subprocess.Popen([*command, str(settings_path), str(out)], cwd=REPO_ROOT, env=env)
            )
        codes = [proc.wait(timeout=CHILD_TIMEOUT_S) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(codes):
        raise RuntimeError(f"a rank of the group of {world} failed (exit codes {codes})")
    results: list[dict[str, Any]] = json.loads(out.read_text())
    return results


def _mfu(tokens_per_s: float, flops_per_token: float, peak: float | None, devices: int) -> Any:
    return None if peak is None else flops_utilisation(tokens_per_s, flops_per_token, peak, devices)


def run(settings: Settings) -> dict[str, Any]:
    cuda = settings.backend == "nccl"
    with tempfile.TemporaryDirectory(prefix="geofed-throughput-") as tmp:
        rows = [row for world in settings.world_sizes for row in _group(settings, world, Path(tmp))]
    accelerator = torch.cuda.get_device_name(0) if cuda else None
    peaks: dict[str, float | None] = {
        p: peak_flops(accelerator, p, settings.peak_flops.get(p)) for p in settings.precisions
    }
    for row in rows:
        devices = row["world_size"]
        peak = peaks[row["precision"]]
        row["devices"] = devices
        row["ratio"] = row["tokens_per_s"] / (row["plain_tokens_per_s"] * devices)
        row["mfu"] = _mfu(row["tokens_per_s"], row["flops_per_token"], peak, devices)
        row["plain_mfu"] = _mfu(row["plain_tokens_per_s"], row["flops_per_token"], peak, 1)
    checks = [
        {
            "name": f"{r['parallelism']} {r['precision']} x{r['world_size']}: "
            f">= {TARGET_RATIO} of plain torch's tokens/s per device",
            "measured": f"{r['ratio']:.3f}",
            "met": r["ratio"] >= TARGET_RATIO,
        }
        for r in rows
    ]
    return {
        "benchmark": "training_throughput",
        "machine": describe_machine(),
        "device": accelerator or "cpu",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "peak_flops": peaks,
        "settings": settings.record(),
        "parameters": rows[0]["parameters"],
        "flops_per_token": rows[0]["flops_per_token"],
        "results": rows,
        "targets": checks,
    }


def _rate(value: float) -> str:
    return f"{value / 1e3:,.1f}k" if value < 1e6 else f"{value / 1e6:,.2f}M"


def _optional(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def render(report: dict[str, Any]) -> str:
    settings = report["settings"]
    opts = settings["task_options"]
    peaks = {k: v for k, v in report["peak_flops"].items() if v is not None}
    overrides = settings["peak_flops"]
    lines = [
        "# Training throughput inside a region",
        "",
        f"Machine: {machine_line(report['machine'])}; device: {report['device']}.",
        "",
        f"Llama `{settings['preset']}` ({report['parameters'] / 1e6:.2f}M parameters, "
        f"{report['flops_per_token'] / 1e6:.1f} MFLOP per token; options {json.dumps(opts)}), "
        f"{settings['repeats']} x {settings['steps']} timed steps after {settings['warmup']} "
        f"untimed, backend {settings['backend']}"
        + ("." if report["gpus"] else f", {settings['threads']} torch threads per group."),
        "MFU peak: "
        + (
            ", ".join(f"{k} {v / 1e12:g} TFLOP/s" for k, v in sorted(peaks.items()))
            + (" (--peak-flops)" if overrides else " (the known GPUs' data sheets)")
            if peaks
            else "none known for this device, so MFU is not reported (give --peak-flops)"
        )
        + ".",
        "",
        "Each row: the best of the region's timed rounds and of the plain loop's runs, "
        "measured alternately in the same processes; ratio = the region's tokens/s over the "
        "plain loop's on one rank's device (a GPU, or on the CPU one rank's share of the "
        "threads) times the ranks.",
        "",
        "| parallelism | precision | ranks | step ms | tokens/s | plain tokens/s | ratio "
        "| MFU | plain MFU | peak memory | data wait s | all-reduce s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        lines.append(
            f"| {row['parallelism']} | {row['precision']} | {row['world_size']} "
            f"| {row['step_s'] * 1e3:.1f} | {_rate(row['tokens_per_s'])} "
            f"| {_rate(row['plain_tokens_per_s'])} | {row['ratio']:.3f} "
            f"| {_optional(row['mfu'], '.1%')} | {_optional(row['plain_mfu'], '.1%')} "
            f"| {_memory(row['peak_memory_bytes'])} "
            f"| {row['data_wait_s']:.3f} | {_optional(row['comm_s'], '.3f')} |"
        )
    lines += targets_table(report["targets"])
    return "\n".join(lines) + "\n"


def _memory(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f} GiB"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [CHILD_FLAG]:
        return run_child(args[1:])
    settings = parse_args(args)
    print(f"machine: {machine_line(describe_machine())}", file=sys.stderr)
    started = time.perf_counter()
    try:
        report = run(settings)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"training_throughput: {exc}", file=sys.stderr)
        return 1
    report["total_wall_s"] = time.perf_counter() - started
    publish(report, settings.out, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
