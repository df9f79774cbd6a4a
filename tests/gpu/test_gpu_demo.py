"""``geofed demo`` on the GPU(s): a short run to the end of its job, on NCCL ranks."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.gpu import require_cuda

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1200)
def test_demo_runs_two_rounds_on_the_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_cuda()
    work = tmp_path / "demo"
    command = [sys.executable, "-m", "geofed", "demo", "--rounds", "2", "--workdir", str(work)]
    done = subprocess.run(
        [*command, "--timeout", "900"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=1100,
        check=False,
    )
    with capsys.disabled():
        print(f"\n{done.stdout}")
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "nccl" in done.stdout, "the demo says where its regions train"
    summary = json.loads((work / "summary.json").read_text())
    assert summary["job_state"] == "completed"
    assert summary["rounds_completed"] == 2
    assert math.isfinite(summary["final_loss"])
