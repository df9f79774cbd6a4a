"""A region's worker group run by the ``slurm`` launcher on a real Slurm cluster.

Slurm (munged, slurmctld, two slurmd) runs on this machine (:mod:`tests.support.slurm`);
the agent side runs outside any allocation, so ``srun`` requests one of both nodes, runs
one elastic launcher per node, and the group of one gloo rank per node trains rounds
exactly as two DDP ranks would; a rank killed mid-round is restarted by the elastic
launchers and the round redone from the regional checkpoint. An agent inside an
allocation (``SLURM_JOB_ID`` set, as in an ``sbatch`` script; here one that
``salloc --no-shell`` made) runs its step in that allocation. A node whose rank is slowed
on purpose is found straggling, left out (a new step with ``--exclude``, on the other node
alone) and brought back after its rounds out.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from geofed.ports import unused_port
from regional_agent.handoff.directory import HandoffDir
from regional_agent.launch.exclusion import (
    NodeExclusions,
    StragglerExclusionConfig,
    apply_exclusions,
)
from regional_agent.launch.slurm import SlurmLauncher, SlurmOptions
from regional_agent.launch.worker_group import WorkerGroup, WorkerGroupConfig
from regional_agent.rounds.stragglers import StragglerRule, StragglerWatch
from tests.support.slurm import SlurmCluster, slurm_cluster
from tests.support.tiny_task import TinyTask
from tests.support.worker_group import (
    instruction,
    launcher_config,
    save_state,
    simulate_region,
    wait_for_progress,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def program_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as running:
        yield running


def client_environ(cluster: SlurmCluster) -> dict[str, str]:
    """The agent's environment: this cluster's, and no allocation of the test's own."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    environ.update(cluster.env)
    return environ


@contextmanager
def allocation(cluster: SlurmCluster) -> Iterator[str]:
    """An allocation of both nodes (``salloc --no-shell``), cancelled after."""
    done = subprocess.run(
        ["salloc", "--no-shell", "--nodes=2", "--job-name=geofed-alloc"],
        env=client_environ(cluster),
        capture_output=True,
        text=True,
        timeout=30,
    )
    found = re.search(r"Granted job allocation (\d+)", done.stderr + done.stdout)
    assert found, done.stderr + cluster.logs()
    job_id = found.group(1)
    try:
        yield job_id
    finally:
        subprocess.run(["scancel", job_id], env=client_environ(cluster), timeout=30, check=False)


def slurm_group(cluster: SlurmCluster, workdir: Path, job_id: str | None) -> WorkerGroup:
    environ = client_environ(cluster)
    if job_id is not None:
        environ["SLURM_JOB_ID"] = job_id  # as inside an sbatch script
    launcher = SlurmLauncher(
        workdir,
        launcher_config(nproc_per_node=1, nnodes=2),
        SlurmOptions(rdzv_port=unused_port()),
        environ=environ,
    )
    return WorkerGroup(workdir, launcher, WorkerGroupConfig(start_timeout_s=120.0))


def rank_tasks(handoff: HandoffDir) -> dict[int, dict[str, str]]:
    """Each rank's Slurm job and task, read from its process's environment."""
    return {
        s.rank: {
            k: v for k, v in environ_of(s.pid).items() if k in ("SLURM_JOB_ID", "SLURM_PROCID")
        }
        for s in handoff.read_rank_statuses()
    }


@pytest.mark.asyncio
async def test_srun_requests_an_allocation_and_recovers_a_killed_rank(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    workdir = tmp_path / "workers"
    theta0 = TinyTask().build_model(seed=3).state_dict()
    base = save_state(tmp_path / "base.pt", theta0)
    group = slurm_group(cluster, workdir, None)
    try:
        await group.start()
        handoff = HandoffDir(workdir)
        assert program_of(group.launcher.pid or -1) == "srun"
        statuses = {s.rank: s for s in handoff.read_rank_statuses()}
        tasks = await asyncio.to_thread(rank_tasks, handoff)
        # rank 0 on the step's first node, both in the job srun was granted
        assert {rank: task["SLURM_PROCID"] for rank, task in tasks.items()} == {0: "0", 1: "1"}
        slow = {"step_delay_s": 0.02}
        first = await group.run_round(instruction("sl", 0, base, task_options=slow), 60)
        second = await group.run_round(instruction("sl", 1, base, task_options=slow), 60)
        round_task = asyncio.create_task(
            group.run_round(instruction("sl", 2, base, task_options=slow), 120)
        )
        await wait_for_progress(handoff, "sl", 2, steps=5)
        os.kill(statuses[1].pid, signal.SIGKILL)
        third = await round_task
        assert group.restart_count >= 1
    finally:
        status = await group.stop()
    assert status == 0, cluster.logs() + group.handoff.launcher_log_path.read_text()[-3000:]
    expected = simulate_region(theta0, rounds=3)
    for result, reference in zip((first, second, third), expected, strict=True):
        assert result.summary.world_size == 2
        for name, tensor in reference.items():
            torch.testing.assert_close(result.params[name], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.asyncio
async def test_an_agent_inside_an_allocation_runs_its_step_there(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    workdir = tmp_path / "workers"
    theta0 = TinyTask().build_model(seed=3).state_dict()
    base = save_state(tmp_path / "base.pt", theta0)
    with allocation(cluster) as job_id:
        group = slurm_group(cluster, workdir, job_id)
        try:
            await group.start()
            tasks = await asyncio.to_thread(rank_tasks, group.handoff)
            assert tasks == {
                0: {"SLURM_JOB_ID": job_id, "SLURM_PROCID": "0"},
                1: {"SLURM_JOB_ID": job_id, "SLURM_PROCID": "1"},
            }
            results = [await group.run_round(instruction("in", r, base), 60) for r in range(2)]
        finally:
            status = await group.stop()
    assert status == 0, cluster.logs()
    for result, reference in zip(results, simulate_region(theta0, rounds=2), strict=True):
        for name, tensor in reference.items():
            torch.testing.assert_close(result.params[name], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.asyncio
async def test_a_straggling_node_is_left_out_and_brought_back(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Rank 1, alone on gfnode2, sleeps in every loss call. After 2 rounds the straggler
    rule names its node (by its Slurm name), the group is relaunched at the round boundary
    on gfnode1 alone, trains a round there, and gets gfnode2 back (whose rank, still
    slow, would be found again)."""
    workdir = tmp_path / "workers"
    base = save_state(tmp_path / "base.pt", TinyTask().build_model(seed=3).state_dict())
    group = slurm_group(cluster, workdir, None)
    watch = StragglerWatch(StragglerRule(ratio=1.3, window=2, min_rounds=2))
    config = StragglerExclusionConfig(exclude=True, readmit_after_rounds=1)
    exclusions = NodeExclusions(config, nnodes=2)
    slow = {"slow_rank": 1, "slow_rank_delay_s": 0.05}
    sizes, nodes, changes = [], [], []
    try:
        await group.start()
        for round_ in range(4):
            inst = instruction("straggle", round_, base, task_options=slow)
            result = await group.run_round(inst, 120)
            sizes.append(result.summary.world_size)
            stats = result.summary.stats
            assert stats is not None
            nodes.append(sorted(t.host for t in stats.ranks))
            verdict = watch.observe(round_, stats.ranks)
            change = await apply_exclusions(group, exclusions, verdict)
            if change is not None:
                changes.append(change)
    finally:
        status = await group.stop()
    assert status == 0, cluster.logs() + group.handoff.launcher_log_path.read_text()[-3000:]
    assert sizes == [2, 2, 1, 2], sizes
    assert nodes[0] == ["gfnode1", "gfnode2"], "each rank named by its Slurm node"
    assert nodes[2] == ["gfnode1"]
    left, back = changes
    assert left.excluded == {"gfnode2"}
    assert left.reason.startswith("node(s) gfnode2 left out: rank 1 (node 1 on gfnode2) over 1.3x")
    assert (back.excluded, back.reason) == (
        frozenset(),
        "node gfnode2 back after 1 round(s) left out",
    )
