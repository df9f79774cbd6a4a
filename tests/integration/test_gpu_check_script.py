"""``scripts/gpu-check.sh`` as an operator runs it: without CUDA it refuses and says how to
exercise it; with ``--cpu`` its steps run for real at smoke sizes and the report holds
each step's exit status and figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.waiting import alive

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT
    )


def test_without_cuda_the_check_refuses_and_writes_nothing(tmp_path: Path) -> None:
    done = run("--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr
    assert "--cpu" in done.stderr
    assert not (tmp_path / "out").exists()


def test_on_the_cpu_the_steps_run_and_the_report_holds_their_figures(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run("--cpu", "--only", "tput-350m,quantize", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["cpu"] is True
    assert report["gpus"]["devices"] == []
    assert list(report["steps"]) == ["tput-350m", "quantize"]
    throughput = report["steps"]["tput-350m"]
    assert throughput["exit"] == 0
    assert not throughput["timed_out"]
    (row,) = throughput["figures"]["results"]
    assert row["config"] == "fsdp bf16 x1"
    assert row["tokens_per_s"] > 0
    quantize = report["steps"]["quantize"]["figures"]
    assert quantize["device"] == "cpu"
    assert quantize["quantize_s_per_gb"] > 0
    assert (out / "quantize.log").exists()
    assert (out / "gpu-check.md").read_text().startswith("# GPU check")


def test_a_step_past_its_limit_is_stopped_with_its_children_and_recorded(tmp_path: Path) -> None:
    from benchmarks.gpu_check import Step, run_step

    pid_file = tmp_path / "child.pid"

    def command(out: Path, gpus: int) -> list[str]:
        # A step that starts a child of its own and never finishes.
        return ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; echo started; wait"]

    step = Step("hangs", command, 1.0, lambda path: {})
    entry = run_step(step, tmp_path, 0)
    assert entry["timed_out"] is True
    assert entry["exit"] is None
    assert entry["output"] is None
    assert "figures" not in entry
    assert entry["tail"] == ["started"]
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10  # killed at once; reaped by init soon after
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)
