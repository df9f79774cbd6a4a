"""``geofed demo --wan ... --chaos``: a short demo through an emulated WAN with real faults.

The demo runs as a process. Its regions reach the coordinator through the WAN emulator;
while the job runs it kills an agent, a worker and the coordinator with SIGKILL, restarts
its broker and cuts a region off through its WAN link. Its supervision restarts what was
killed, as the shipped systemd units would, and says so in its live view. The demo must
exit 0, having reported every fault it injected, nothing acknowledged lost, every region's
parameters equal to what the coordinator published, WAN totals that never drop (the
accepted deltas from the coordinator's durable receipts, as many as its audit log
accepted), and each region's compute utilization, with a timeline line per round its
agent recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from geofed_cli.demo.chaos import FAULTS
from tests.support.federation import TINY_CHARLM

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
REGIONS = ("eu-west", "us-east")
ROUNDS = 6


@pytest.mark.timeout(420)
def test_a_chaos_demo_over_a_wan_loses_nothing_and_its_regions_agree(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    command = [sys.executable, "-m", "geofed", "demo", "--regions", "2", "--rounds", str(ROUNDS)]
    # One inner step, one validation batch and one worker a region: what the chaos costs
    # is the point, not the training, and the worker still records a training interval
    # per round (each rank a region adds a torch process to every start and restart).
    task = {**TINY_CHARLM, "val_batches": 1}
    command += ["--inner-steps", "1", "--workers", "1", "--task-options", json.dumps(task)]
    command += ["--wan", "20mbit,40ms", "--chaos", "--workdir", str(work), "--timeout", "360"]
    # On the CPU wherever it runs: a worker count is refused where a GPU is visible.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=400, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, "...\n" + output[-3000:]
    assert "20 Mbit/s, 40 ms RTT (emulated)" in done.stdout
    summary = json.loads((work / "summary.json").read_text())
    assert summary["job_state"] == "completed"

    # The faults, and what they cost: nothing.
    chaos = summary["chaos"]
    assert [fault["kind"] for fault in chaos["injected"]] == list(FAULTS), chaos
    details = {fault["kind"]: fault["detail"] for fault in chaos["injected"]}
    for kind in ("kill-agent", "kill-worker", "kill-coordinator"):
        assert details[kind].startswith("SIGKILL to"), details
    assert details["partition-region"].startswith("cut off from the coordinator"), details
    assert chaos["lost"] == [], chaos
    assert chaos["regions_agree"], chaos
    assert set(chaos["regions"]) == set(REGIONS)
    assert "lost: nothing acknowledged" in output

    # The WAN totals survive the coordinator's restart: the accepted deltas are the
    # coordinator's durable receipts, as many as the audit log accepted, and no total
    # ever drops from one round to the next.
    assert summary["deltas_accepted"] == chaos["accepted"] > 0, (summary, chaos)
    for key in ("wan_bytes_up", "wan_bytes_down", "fp32_bytes_equivalent"):
        seen = [entry[key] for entry in summary["rounds"]] + [summary[key]]
        assert seen == sorted(seen), (key, seen)

    # Supervision restarted the killed daemons and said so.
    assert "agent-eu-west was killed by SIGKILL; restarting in 1 s" in output, output[-3000:]
    assert "agent-eu-west restarted (pid " in output
    assert summary["restarts"].get("coordinator", 0) >= 1, summary["restarts"]
    assert summary["restarts"].get("agent-eu-west", 0) >= 1, summary["restarts"]
    agent_log = (work / "logs" / "agent-eu-west.log").read_text()
    starts = agent_log.split("agent for region eu-west of federation demo starting")
    assert len(starts) >= 2, agent_log[-3000:]
    assert "delta accepted" in starts[-1], agent_log[-3000:]  # the restarted agent delivered

    # Each region's compute utilization, and a timeline line per recorded round.
    utilization = summary["compute_utilization"]
    assert set(utilization) == set(REGIONS)
    for region, value in utilization.items():
        assert value is not None, region
        assert 0 < value <= 1, (region, value)
    for region in REGIONS:
        lines = (work / "agents" / region / "round_timeline.jsonl").read_text().splitlines()
        rounds = [json.loads(line) for line in lines]
        numbers = [entry["round"] for entry in rounds]
        assert set(numbers) <= set(range(ROUNDS)), (region, numbers)
        # A restarted agent may only re-send a spooled delta (upload, wait) for its round.
        trained = [entry for entry in rounds if "train" in entry["seconds"]]
        assert len(trained) >= ROUNDS // 2, (region, numbers)
        for entry in trained:
            assert {"sync", "train"} <= set(entry["seconds"]), entry
        for entry in rounds:
            assert entry["seconds"], entry
            worker = entry.get("worker")
            if worker is not None:
                assert worker["end"] > worker["start"]
