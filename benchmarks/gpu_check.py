"""Every GPU figure geofed needs, gathered in one run (``scripts/gpu-check.sh``).

    scripts/gpu-check.sh [--out DIR] [--only STEP,...] [--cpu]

On a machine with CUDA it runs each step in a process of its own, under its own time
limit (about 8 minutes in all), and keeps going when one fails:

========== ================================================ ===========================
step       runs                                             figures
========== ================================================ ===========================
tests      ``pytest tests/gpu`` (NCCL worker groups, the    tests, failures, errors
           production delta path, the demo, 125M llama)
tput-350m  ``benchmarks.training_throughput --preset 350m``  tokens/s, ratio to plain
           FSDP2 in bf16 on every GPU, against plain torch  torch, MFU, peak memory
                                                            per rank
tput-1b    the same at ``--preset 1b``
quantize   ``benchmarks.handoff --device cuda``: the round's seconds to quantize the delta
           delta quantized on the GPU against the fp32     per GB of fp32 on the
           hand-off                                         device; both hand-offs
round-gap  ``benchmarks.utilization --sizes l`` with        per mode: compute
           ``overlap: none`` and ``delayed``                utilization, idle seconds
                                                            per round, the workers'
                                                            non-training seconds (the
                                                            delayed round's fold)
========== ================================================ ===========================

It writes ``DIR/gpu-check.json`` (the machine and its GPUs, each step's command, exit
status, seconds, figures, and the files of its full output) and ``DIR/gpu-check.md``.
Exit status: 0 when every step ran to completion, 1 when one failed or ran out of time,
2 without CUDA. ``--cpu`` runs the same steps at smoke sizes on the CPU (without
``tests``, which needs CUDA): it exercises the script where no GPU is, and measures
nothing worth reporting.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._machine import describe_machine, machine_line
from benchmarks._report import publish

#: Lines of a failed step's output kept in the report.
_TAIL_LINES = 20


@dataclass(frozen=True)
class Step:
    """One measurement: its command (given the output file and the GPU count), its time
    limit, and how its figures are read from the JSON it writes."""

    name: str
    command: Callable[[Path, int], list[str]]
    timeout_s: float
    figures: Callable[[Path], dict[str, Any]]
    cuda_only: bool = False


def _module(name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", name, *args]


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def junit_figures(path: Path) -> dict[str, Any]:
    """Counts from pytest's JUnit XML: tests, failures, errors, skipped, seconds."""
    suites = ET.parse(path).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    if suite is None:
        raise ValueError(f"{path}: no testsuite element")
    counts = {key: int(suite.get(key, "0")) for key in ("tests", "failures", "errors", "skipped")}
    return {**counts, "seconds": float(suite.get("time", "0"))}


def throughput_figures(path: Path) -> dict[str, Any]:
    """Per configuration of ``benchmarks.training_throughput``: tokens/s, the ratio to the
    plain torch loop, MFU (None without a known peak) and peak memory per rank."""
    report = _json(path)
    keys = ("tokens_per_s", "plain_tokens_per_s", "ratio", "mfu", "peak_memory_bytes")
    return {
        "preset": report["settings"]["preset"],
        "parameters": report["parameters"],
        "device": report["device"],
        "results": [
            {
                "config": f"{row['parallelism']} {row['precision']} x{row['world_size']}",
                **{key: row.get(key) for key in keys},
            }
            for row in report["results"]
        ],
    }


def quantize_figures(path: Path) -> dict[str, Any]:
    """Rank 0's quantization of the delta (with its residual) in seconds per GB of fp32
    delta, and both hand-offs' totals, from ``benchmarks.handoff``."""
    report = _json(path)
    params = int(report["settings"]["params"])
    delta = report["medians_s"]["delta"]
    quantize_s = float(delta["worker: quantize + residual"])
    return {
        "device": report["settings"]["device"],
        "params": params,
        "quantize_s": quantize_s,
        "quantize_s_per_gb": quantize_s / (4 * params / 1e9),
        "delta_handoff_s": float(delta["total"]),
        "params_handoff_s": float(report["medians_s"]["params"]["total"]),
    }


#: The round timeline's phases besides training: what a region's GPUs wait for.
_IDLE_PHASES = ("sync_s", "load_s", "encode_s", "upload_s", "wait_s")


def round_gap_figures(path: Path) -> dict[str, Any]:
    """Per overlap mode and size of ``benchmarks.utilization``, averaged over regions:
    compute utilization, training seconds per round, the seconds per round the timeline
    spends in other phases (idle, unless overlapped), and ``load_s``, the worker group's
    own non-training time (under ``delayed``, where the late update is folded in)."""
    report = _json(path)
    modes: dict[str, Any] = {}
    for mode, entry in report["modes"].items():
        if not entry.get("available"):
            modes[mode] = {"available": False, "detail": entry.get("detail")}
            continue
        sizes: dict[str, Any] = {}
        for size, run in entry.get("runs", {}).items():
            regions = list(run.get("regions", {}).values())
            if not regions:
                sizes[size] = {"error": run.get("error", "no region reported")}
                continue
            means = [region["mean_per_round"] for region in regions]
            sizes[size] = {
                "parameters": run["parameters"],
                "compute_utilization": _mean(r["compute_utilization"] for r in regions),
                "train_s": _mean(m["train_s"] for m in means),
                "other_s": _mean(sum(m[p] for p in _IDLE_PHASES) for m in means),
                "load_s": _mean(m["load_s"] for m in means),
            }
        modes[mode] = {"available": True, "sizes": sizes}
    return {"modes": modes}


def _mean(values: Any) -> float:
    items = list(values)
    return float(sum(items)) / len(items)


def steps(cpu: bool) -> list[Step]:
    """The steps, with GPU sizes, or smoke sizes on the CPU."""

    def throughput(preset: str, steps_: int) -> Callable[[Path, int], list[str]]:
        def command(out: Path, gpus: int) -> list[str]:
            if cpu:
                sizing = ["--smoke", "--world-sizes", "1"]
            else:
                sizing = ["--preset", preset, "--steps", str(steps_), "--repeats", "2"]
                sizing += ["--world-sizes", str(gpus)]
            return _module(
                "benchmarks.training_throughput",
                *sizing,
                "--parallelism=fsdp",
                "--precision=bf16",
                f"--out={out}",
            )

        return command

    def quantize(out: Path, gpus: int) -> list[str]:
        sizing = ["--smoke", "--device=cpu"] if cpu else ["--params=1e8", "--device=cuda"]
        return _module("benchmarks.handoff", *sizing, f"--out={out}")

    def round_gap(out: Path, gpus: int) -> list[str]:
        sizing = ["--smoke"] if cpu else ["--sizes=l", "--rounds=3"]
        return _module("benchmarks.utilization", *sizing, "--modes=none,delayed", f"--out={out}")

    def tests(out: Path, gpus: int) -> list[str]:
        return _module("pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={out}")

    return [
        Step("tests", tests, 150.0, junit_figures, cuda_only=True),
        Step("tput-350m", throughput("350m", 10), 60.0, throughput_figures),
        Step("tput-1b", throughput("1b", 6), 90.0, throughput_figures),
        Step("quantize", quantize, 40.0, quantize_figures),
        Step("round-gap", round_gap, 130.0, round_gap_figures),
    ]


def run_step(step: Step, out_dir: Path, gpus: int) -> dict[str, Any]:
    """Run ``step`` to completion or its time limit; what it did and its figures."""
    suffix = ".xml" if step.name == "tests" else ".json"
    out = out_dir / f"{step.name}{suffix}"
    log_path = out_dir / f"{step.name}.log"
    command = step.command(out, gpus)
    started = time.monotonic()
    with log_path.open("wb") as log_file:
        # A session of its own: a step that runs out of time is stopped with everything
        # it started (worker groups, agents, a coordinator).
        process = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc: int | None = process.wait(timeout=step.timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    entry: dict[str, Any] = {
        "command": command,
        "timeout_s": step.timeout_s,
        "seconds": round(time.monotonic() - started, 1),
        "exit": rc,
        "timed_out": rc is None,
        "log": log_path.name,
        "output": out.name if out.exists() else None,
    }
    if out.exists():
        try:
            entry["figures"] = step.figures(out)
        except (KeyError, TypeError, ValueError, ET.ParseError, ZeroDivisionError) as exc:
            entry["figures_error"] = f"{type(exc).__name__}: {exc}"
    if rc != 0:
        lines = log_path.read_text(errors="replace").splitlines()
        entry["tail"] = lines[-_TAIL_LINES:]
    return entry


def describe_gpus() -> dict[str, Any]:
    """CUDA as torch sees it, and the driver as nvidia-smi reports it (where present)."""
    import torch

    info: dict[str, Any] = {
        "cuda_available": torch.cuda.is_available(),
        "torch_cuda": torch.version.cuda,
        "devices": [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
    }
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        query = "--query-gpu=name,driver_version,memory.total"
        done = subprocess.run(
            [smi, query, "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
        info["nvidia_smi"] = done.stdout.strip().splitlines() if done.returncode == 0 else None
    return info


def markdown(report: dict[str, Any]) -> str:
    """The report as a page: the machine, then one line per step with its figures."""
    gpus = report["gpus"]
    lines = [
        "# GPU check",
        "",
        f"Machine: {machine_line(report['machine'])}.",
        f"GPUs: {', '.join(gpus['devices']) or 'none'} (CUDA {gpus['torch_cuda']}).",
    ]
    if report["cpu"]:
        lines.append("Run with --cpu: smoke sizes on the CPU, not a measurement.")
    lines += ["", "| step | exit | seconds | figures |", "|---|---|---|---|"]
    for name, entry in report["steps"].items():
        exit_text = "timed out" if entry["timed_out"] else str(entry["exit"])
        figures = entry.get("figures", entry.get("figures_error", "none"))
        lines.append(f"| {name} | {exit_text} | {entry['seconds']} | `{json.dumps(figures)}` |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu-check.sh", description="Every GPU figure geofed needs, in one run."
    )
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="output folder")
    parser.add_argument("--only", help="comma list of steps (default: all)")
    parser.add_argument(
        "--cpu", action="store_true", help="smoke sizes on the CPU: exercise, not measure"
    )
    args = parser.parse_args(argv)
    chosen = steps(args.cpu)
    if args.only is not None:
        names = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = sorted(set(names) - {step.name for step in chosen})
        if unknown:
            parser.error(f"unknown step(s) {unknown}; the steps: {[s.name for s in chosen]}")
        chosen = [step for step in chosen if step.name in names]
    gpus = describe_gpus()
    if not args.cpu and not gpus["cuda_available"]:
        print(
            "gpu-check needs a CUDA GPU (torch.cuda.is_available() is False); "
            "--cpu runs its steps at smoke sizes on the CPU",
            file=sys.stderr,
        )
        return 2
    if args.cpu:
        chosen = [step for step in chosen if not step.cuda_only]
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "benchmark": "gpu_check",
        "machine": describe_machine(),
        "gpus": gpus,
        "cpu": args.cpu,
        "steps": {},
    }
    for step in chosen:
        print(f"gpu-check: {step.name} (at most {step.timeout_s:.0f} s)", file=sys.stderr)
        report["steps"][step.name] = run_step(step, args.out, len(gpus["devices"]))
    publish(report, args.out / "gpu-check.json", markdown(report))
    ok = all(entry["exit"] == 0 and "figures" in entry for entry in report["steps"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
