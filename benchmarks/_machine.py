"""What a benchmark ran on: hardware, software and how busy the machine was.

Every benchmark stores :func:`describe_machine` next to its figures, because a number
means little without the machine it came from, and figures from a busy machine must
be read as such (the load average is sampled when the description is taken).
:func:`targets_table` renders the verdicts every report states next to them.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

_REPO_ROOT = Path(__file__).resolve().parent.parent


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_total_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _git_revision() -> dict[str, Any]:
    """Return the checked-out commit and whether the tree has local changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=_REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=_REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": head, "dirty": bool(status.strip())}


def describe_machine() -> dict[str, Any]:
    """Return a JSON-ready description of this machine, software and current load."""
    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": affinity,
        "memory_total_bytes": _memory_total_bytes(),
        "load_average_1_5_15min": load,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "git": _git_revision(),
    }


def machine_line(machine: dict[str, Any]) -> str:
    """Return a one-line summary of :func:`describe_machine` for printed reports."""
    load = machine.get("load_average_1_5_15min")
    load_text = "n/a" if load is None else "/".join(f"{x:g}" for x in load)
    memory = machine.get("memory_total_bytes")
    memory_text = "n/a" if memory is None else f"{memory / 2**30:.0f} GiB"
    return (
        f"{machine['cpu_model']}, {machine['usable_cpus']} usable CPUs, {memory_text} RAM, "
        f"load {load_text}; Python {machine['python']}, torch {machine['torch']} "
        f"({machine['torch_cpu_capability']}, {machine['torch_threads']} threads)"
    )


def targets_table(checks: list[dict[str, Any]]) -> list[str]:
    """The markdown lines of a report's "Targets (DESIGN)" section.

    ``met`` is True, False or None (a figure reported, not judged).
    """
    lines = ["", "## Targets (DESIGN)", "", "| target | measured | verdict |", "|---|---|---|"]
    for check in checks:
        verdict = {True: "met", False: "NOT met", None: "reported"}[check["met"]]
        lines.append(f"| {check['name']} | {check['measured']} | {verdict} |")
    return lines
