"""A region of two nodes on one machine: each node its own network namespace and address.

The head node (the agent's) runs in the host's namespace with the hand-off directory; the
other node runs ``python -m regional_agent.launch.node`` inside a network namespace,
joined by a veth pair, and inside a mount namespace where the head's directory (the
hand-off files, the base parameters, the regional checkpoint) is hidden under an empty
tmpfs: its rank can only train if rank 0 broadcasts everything. The other node gets the
lower address, so torch's rendezvous numbers its rank first; the workers renumber the
head's rank to 0. One gloo rank per node, c10d rendezvous at the head.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from geofed.ports import unused_port
from geofed.timeouts import Timeout
from regional_agent.handoff.directory import HandoffDir
from regional_agent.launch.launcher import LocalElasticLauncher, descendants
from regional_agent.launch.worker_group import WorkerGroup, WorkerGroupConfig
from tests.support.netns import NodePair, node_pair
from tests.support.tiny_task import TinyTask
from tests.support.worker_group import (
    REPO_ROOT,
    instruction,
    launcher_config,
    save_state,
    simulate_region,
    wait_for_progress,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HEAD_ADDR, NODE_ADDR = "10.213.77.2", "10.213.77.1"


def start_other_node(
    pair: NodePair, endpoint: str, rdzv_id: str, hidden: Path, node_dir: Path, logs: Path
) -> subprocess.Popen[bytes]:
    """The other node's launcher, in its network namespace, with ``hidden`` covered."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "GLOO_SOCKET_IFNAME": pair.node_if}
    hide = f'mount -t tmpfs none "{hidden}" && exec "$0" "$@"'
    unshare = ["unshare", "--mount", "--propagation", "private", "sh", "-c", hide]
    node_launcher = [
        *(sys.executable, "-m", "regional_agent.launch.node", "--workdir", str(node_dir)),
        *("--nnodes", "2", "--nproc-per-node", "1", "--backend", "gloo"),
        *("--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id, "--local-addr", NODE_ADDR),
        *("--max-restarts", "2", "--collective-timeout-s", "60", "--poll-interval-s", "0.02"),
    ]
    with (logs / "node1.log").open("wb") as log:
        return subprocess.Popen(
            pair.in_node(*unshare, *node_launcher),
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


@pytest.mark.asyncio
async def test_two_node_region_trains_and_recovers_a_lost_node(tmp_path: Path) -> None:
    head_root = tmp_path / "head"  # everything only the head node may see
    workdir, node_dir = head_root / "workers", tmp_path / "node1"
    workdir.mkdir(parents=True)
    theta0 = TinyTask().build_model(seed=3).state_dict()
    base = save_state(head_root / "base.pt", theta0)
    rdzv_id = f"region-{os.getpid()}"
    with node_pair(HEAD_ADDR, NODE_ADDR) as pair:
        endpoint = f"{HEAD_ADDR}:{unused_port(HEAD_ADDR)}"
        node = start_other_node(pair, endpoint, rdzv_id, head_root, node_dir, tmp_path)
        config = launcher_config(
            nproc_per_node=1,
            nnodes=2,
            rdzv_endpoint=endpoint,
            rdzv_id=rdzv_id,
            local_addr=HEAD_ADDR,
            env={"PYTHONPATH": str(REPO_ROOT), "GLOO_SOCKET_IFNAME": pair.head_if},
        )
        launcher = LocalElasticLauncher(workdir, config)
        group = WorkerGroup(workdir, launcher, WorkerGroupConfig(start_timeout_s=120.0))
        try:
            try:
                await group.start()
            except Timeout:
                node_logs = [tmp_path / "node1.log", *sorted(node_dir.glob("logs/*.log"))]
                tails = "\n".join(f"--- {p.name} ---\n{p.read_text()[-2000:]}" for p in node_logs)
                pytest.fail(f"the two-node group did not start; the other node's logs:\n{tails}")
            handoff = HandoffDir(workdir)
            statuses = {s.rank: s for s in handoff.read_rank_statuses()}
            assert set(statuses) == {0, 1}
            assert launcher.world_size == 2
            # Rank 0 is the head's own worker, though the rendezvous numbered it second.
            assert statuses[0].pid in descendants([launcher.pid or -1])
            assert statuses[1].pid in descendants([node.pid])

            slow = {"step_delay_s": 0.02}
            first = await group.run_round(instruction("mn", 0, base, task_options=slow), 60)
            second = await group.run_round(instruction("mn", 1, base, task_options=slow), 60)
            round_task = asyncio.create_task(
                group.run_round(instruction("mn", 2, base, task_options=slow), 120)
            )
            await wait_for_progress(handoff, "mn", 2, steps=5)
            lost = HandoffDir(node_dir).read_rank_statuses()
            (victim,) = [s.pid for s in lost if s.rank == 1]
            began = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            third = await round_task
            recovery_s = time.monotonic() - began
        finally:
            await group.stop()
            try:
                node.wait(timeout=30)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()
    print(f"two-node region: round redone {recovery_s:.1f} s after the node lost its rank")
    assert group.restart_count >= 1
    assert node.returncode == 0, (tmp_path / "node1.log").read_text()[-3000:]
    # The redone round resumed from the regional checkpoint that only rank 0 read: the
    # other node's fresh rank took the cursor and the optimizer state from the broadcast.
    expected = simulate_region(theta0, rounds=3)
    for result, reference in zip((first, second, third), expected, strict=True):
        assert result.summary.world_size == 2
        for name, tensor in reference.items():
            torch.testing.assert_close(result.params[name], tensor, rtol=1e-5, atol=1e-6)
    # The other node's directory holds its rank's log and status, nothing of a round.
    left = {str(p.relative_to(node_dir)) for p in node_dir.rglob("*") if p.is_file()}
    assert "ranks/rank-1.json" in left
    assert left <= {"launcher.pid", "logs/launcher.log", "logs/rank-1.log", "ranks/rank-1.json"}
