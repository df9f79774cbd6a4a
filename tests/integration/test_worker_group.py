"""The regional worker group with real processes: torch.distributed.run, 2 gloo ranks.

One group is started for the module (start-up costs seconds) and serves the process
tests in order: rounds on the tiny task, a round of the example task, a worker killed
mid-round (in-place restart), a second supervisor over the same directory, SIGTERM to
the launcher (relaunch), rounds the region is already past, and last a stop mid-round.
The tests after those check configuration and supervision logic without processes.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from geofed.backoff import Backoff
from geofed.heap import RANK_HEAP_ENV
from geofed.params import parameters_vector_hash
from geofed.task import DataShard
from geofed.timeouts import Timeout
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.messages import RankStatus, RoundResult
from regional_agent.handoff.settings import LauncherConfigError, WorkerSettings
from regional_agent.launch.launcher import Launcher, LocalElasticLauncher, descendants
from regional_agent.launch.worker_group import (
    RoundFailed,
    RoundRefused,
    WorkerGroup,
    WorkerGroupConfig,
    WorkerGroupFailed,
    WorkerGroupNotRunning,
)
from regional_agent.worker.optimizer_checkpoint import read_optimizer_state
from tests.support.tiny_task import TinyTask
from tests.support.waiting import alive, eventually
from tests.support.worker_group import (
    STEPS,
    WORLD,
    instruction,
    launcher_config,
    save_state,
    wait_for_progress,
)

CHARLM = "geofed.examples.charlm:CharLMTask"
CHARLM_OPTIONS = {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 16, "batch_size": 4}

pytestmark = pytest.mark.integration
# The group (and its supervisor task) lives on one event loop for the whole module.
on_module_loop = pytest.mark.asyncio(loop_scope="module")


def stand_in(*argv: str, timeout_s: float = 10.0) -> subprocess.Popen[bytes]:
    """Start ``argv`` and wait until /proc shows its command line.

    Popen returns while the exec may still be setting the new program up, and until then
    /proc/<pid>/cmdline reads as empty (for milliseconds, longer on a loaded machine). A
    group left running by a previous supervisor has long been past that point.
    """
    proc = subprocess.Popen(argv)
    expected = "\0".join(argv).encode()
    deadline = time.monotonic() + timeout_s
    while expected not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"{argv} did not start")
        time.sleep(0.01)
    return proc


class Started:
    """The module's running group, what its start-up cost, and its relaunch back-offs."""

    def __init__(self, launcher: LocalElasticLauncher, workdir: Path):
        self.launcher = launcher
        self.workdir = workdir
        self.startup_s = 0.0
        self.backoffs: list[float] = []
        self.group = WorkerGroup(
            workdir, launcher, WorkerGroupConfig(start_timeout_s=120.0), sleep=self.skip_backoff
        )

    async def skip_backoff(self, seconds: float) -> None:
        """Fake clock for relaunch back-off: record the delay, do not wait."""
        self.backoffs.append(seconds)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def started(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Started]:
    workdir = tmp_path_factory.mktemp("region")
    launcher = LocalElasticLauncher(workdir, launcher_config())
    state = Started(launcher, workdir)
    began = time.monotonic()
    await state.group.start()
    state.startup_s = time.monotonic() - began
    yield state
    await state.group.stop()


def simulate_region(task: TinyTask, base: dict[str, torch.Tensor], rounds: int, seed: int):
    """Replay what DDP computes, in this process: mean gradient of the ranks' batches."""
    model = task.build_model()
    optimizer = task.build_optimizer(model.parameters())
    results = []
    cursor = 0
    for _ in range(rounds):
        model.load_state_dict(base)
        for step in range(cursor, cursor + STEPS):
            grads = []
            for rank in range(WORLD):
                shard = DataShard("eu-west", 0, 2, rank, WORLD, seed)
                model.zero_grad(set_to_none=True)
                task.loss(model, task.batch_at(shard, step)).backward()
                grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            for param, *per_rank in zip(model.parameters(), *grads, strict=True):
                param.grad = sum(per_rank) / WORLD
            optimizer.step()
        cursor += STEPS
        results.append({k: v.clone() for k, v in model.state_dict().items()})
    return results


@on_module_loop
async def test_rounds_train_on_one_long_lived_group(started: Started) -> None:
    task = TinyTask()
    theta0 = task.build_model(seed=3).state_dict()
    base = save_state(started.workdir / "alpha-base.pt", theta0)
    pid = started.launcher.pid

    first = await started.group.run_round(instruction("alpha", 0, base), 60)
    began = time.monotonic()
    second = await started.group.run_round(instruction("alpha", 1, base), 60)
    second_s = time.monotonic() - began

    assert started.launcher.pid == pid
    assert second_s < started.startup_s / 4, (second_s, started.startup_s)
    # The ranks' heap gives model-sized buffers back (geofed/heap.py).
    wanted = {f"{k}={v}".encode() for k, v in RANK_HEAP_ENV.items()}
    for status in HandoffDir(started.workdir).read_rank_statuses():
        raw = await asyncio.to_thread(Path(f"/proc/{status.pid}/environ").read_bytes)
        assert wanted <= set(raw.split(b"\0"))
    per_rank_tokens = STEPS * task.tokens(task.batch_at(DataShard("eu-west", 0, 2, 0, WORLD, 7), 0))
    for index, result in enumerate((first, second)):
        summary = result.summary
        assert summary.tokens == WORLD * per_rank_tokens
        assert (summary.steps, summary.cursor) == (STEPS, STEPS * (index + 1))
        assert summary.world_size == WORLD
        assert summary.base_params_hash == parameters_vector_hash(theta0)
        assert summary.params_hash == parameters_vector_hash(result.params)
        assert any(not torch.equal(result.params[k], theta0[k]) for k in theta0)
    # Same base, later data and a warm optimizer: a different result.
    assert first.summary.params_hash != second.summary.params_hash
    checkpoint = HandoffDir(started.workdir).read_checkpoint("alpha")
    assert checkpoint is not None
    assert (checkpoint.job, checkpoint.last_round, checkpoint.cursor) == ("alpha", 1, 2 * STEPS)
    optimizer_state = read_optimizer_state(HandoffDir(started.workdir), "alpha")
    assert optimizer_state is not None
    assert optimizer_state["state"]["0.weight"]["step"].item() == 2 * STEPS

    expected = simulate_region(task, theta0, rounds=2, seed=7)
    for result, reference in zip((first, second), expected, strict=True):
        for name, tensor in reference.items():
            torch.testing.assert_close(result.params[name], tensor, rtol=1e-5, atol=1e-6)


@on_module_loop
async def test_example_task_round(started: Started) -> None:
    from geofed.task import load_task

    task = load_task(CHARLM, CHARLM_OPTIONS)
    theta0 = task.build_model().state_dict()
    base = save_state(started.workdir / "charlm-base.pt", theta0)
    inst = instruction("charlm", 0, base, task=CHARLM, task_options=CHARLM_OPTIONS, inner_steps=5)
    result = await started.group.run_round(inst, 90)
    assert result.summary.tokens == WORLD * 5 * 4 * 16
    assert 3.0 < result.summary.mean_loss < 6.5  # near ln(256) = 5.55 after 5 steps
    assert set(result.params) == set(theta0)
    assert any(not torch.equal(result.params[k], theta0[k]) for k in theta0)


async def run_job(group: WorkerGroup, workdir: Path, job: str, rounds: int, **options: object):
    """Rounds 0..rounds-1, each from the previous result (outer step of lr 1)."""
    base = workdir / "chain-base-0.pt"
    if not base.exists():
        save_state(base, TinyTask().build_model(seed=11).state_dict())
    results: list[RoundResult] = []
    for round_ in range(rounds):
        inst = instruction(job, round_, base, task_options=dict(options))
        results.append(await group.run_round(inst, 60))
        base = workdir / f"chain-base-{round_ + 1}.pt"
        if not base.exists():
            save_state(base, results[-1].params)
    return results


@on_module_loop
async def test_killed_worker_group_redoes_the_round_identically(started: Started) -> None:
    group, launcher, workdir = started.group, started.launcher, started.workdir
    reference = await run_job(group, workdir, "reference", 4)
    await run_job(group, workdir, "crashed", 2, step_delay_s=0.02)
    pid = launcher.pid
    assert group.restart_count == 0

    third = instruction(
        "crashed", 2, workdir / "chain-base-2.pt", task_options={"step_delay_s": 0.02}
    )
    round_task = asyncio.create_task(group.run_round(third, 120))
    handoff = HandoffDir(workdir)
    await wait_for_progress(handoff, "crashed", 2, steps=5)
    os.kill(launcher.worker_pids()[1], signal.SIGKILL)
    result = await round_task

    assert group.restart_count == 1
    assert launcher.pid == pid  # restarted in place by the elastic launcher
    expected = reference[2]
    assert result.params.keys() == expected.params.keys()
    for name, tensor in expected.params.items():
        assert torch.equal(result.params[name], tensor), name
    for name in ("tokens", "mean_loss", "steps", "cursor", "base_params_hash", "params_hash"):
        assert getattr(result.summary, name) == getattr(expected.summary, name), name
    statuses = {s.rank: s for s in handoff.read_rank_statuses()}
    assert {s.restart_count for s in statuses.values()} == {1}


@on_module_loop
async def test_a_new_supervisor_answers_a_completed_round_from_disk(started: Started) -> None:
    workdir = started.workdir
    done_marker = HandoffDir(workdir).done_path("crashed", 2)
    marker_mtime = done_marker.stat().st_mtime_ns
    log_sizes = {p: p.stat().st_size for p in (workdir / "logs").glob("rank-*.log")}
    original = HandoffDir(workdir).read_completed("crashed", 2)
    assert original is not None

    fresh = WorkerGroup(workdir, LocalElasticLauncher(workdir, launcher_config()))
    third = instruction(
        "crashed", 2, workdir / "chain-base-2.pt", task_options={"step_delay_s": 0.02}
    )
    began = time.monotonic()
    result = await fresh.run_round(third, 5)
    assert time.monotonic() - began < 2.0
    assert result.summary == original.summary
    assert all(torch.equal(result.params[k], v) for k, v in original.params.items())
    assert done_marker.stat().st_mtime_ns == marker_mtime
    assert {p: p.stat().st_size for p in log_sizes} == log_sizes
    with pytest.raises(WorkerGroupNotRunning):
        await fresh.run_round(instruction("crashed", 3, workdir / "chain-base-2.pt"), 5)


@on_module_loop
async def test_sigterm_stops_workers_cleanly_and_the_group_is_relaunched(started: Started) -> None:
    group, launcher, workdir = started.group, started.launcher, started.workdir
    handoff = HandoffDir(workdir)
    fourth = instruction(
        "crashed", 3, workdir / "chain-base-3.pt", task_options={"step_delay_s": 0.02}
    )
    round_task = asyncio.create_task(group.run_round(fourth, 120))
    await wait_for_progress(handoff, "crashed", 3, steps=5)
    first_pid = launcher.pid
    workers = set(launcher.worker_pids().values())
    log_offsets = {rank: handoff.rank_log_path(rank).stat().st_size for rank in range(WORLD)}

    launcher.terminate()  # SIGTERM to the elastic launcher, which forwards it
    await eventually(lambda: not any(alive(pid) for pid in workers), timeout_s=30)
    for rank, offset in log_offsets.items():
        with handoff.rank_log_path(rank).open() as f:
            f.seek(offset)
            since = f.read()
        assert "stopping: received SIGTERM" in since, since
        assert "worker stopped cleanly" in since, since

    result = await round_task
    assert started.backoffs  # the launcher's exit counted as a crash
    assert group.relaunch_count == 1
    assert group.restart_count == 2  # the earlier in-place restart, and this relaunch
    assert launcher.pid not in (None, first_pid)
    expected = handoff.read_completed("reference", 3)
    assert expected is not None
    assert result.summary.params_hash == expected.summary.params_hash
    assert result.summary.cursor == 4 * STEPS


@on_module_loop
async def test_rounds_the_region_is_past_are_republished_or_refused(started: Started) -> None:
    group, workdir = started.group, started.workdir
    handoff = HandoffDir(workdir)
    fourth = instruction(
        "crashed", 3, workdir / "chain-base-3.pt", task_options={"step_delay_s": 0.02}
    )
    # As if rank 0 died after the checkpoint but before the done marker.
    handoff.done_path("crashed", 3).unlink()
    result_mtime = handoff.result_path("crashed", 3).stat().st_mtime_ns
    checkpoint_mtime = handoff.checkpoint_path("crashed").stat().st_mtime_ns
    result = await group.run_round(fourth, 30)
    assert result.summary.cursor == 4 * STEPS
    assert handoff.result_path("crashed", 3).stat().st_mtime_ns == result_mtime
    assert handoff.checkpoint_path("crashed").stat().st_mtime_ns == checkpoint_mtime

    assert handoff.prune_rounds("crashed", before_round=2) == 2
    second = instruction("crashed", 1, workdir / "chain-base-1.pt")
    with pytest.raises(RoundFailed, match="not after the last completed round 3"):
        await group.run_round(second, 30)


@on_module_loop
async def test_a_signal_to_one_idle_rank_stops_every_rank(started: Started) -> None:
    """Idle, only rank 0 polls and the ranks meet now and then: a SIGTERM to rank 1 alone
    still reaches rank 0 at the next meeting, and both stop cleanly (the group is then
    relaunched)."""
    group, launcher, workdir = started.group, started.launcher, started.workdir
    handoff = HandoffDir(workdir)
    workers = launcher.worker_pids()
    assert sorted(workers) == list(range(WORLD))
    offsets = {rank: handoff.rank_log_path(rank).stat().st_size for rank in range(WORLD)}
    relaunches = group.relaunch_count

    os.kill(workers[1], signal.SIGTERM)
    await eventually(lambda: not any(alive(pid) for pid in workers.values()), timeout_s=30)
    said = {}
    for rank, offset in offsets.items():
        with handoff.rank_log_path(rank).open() as f:
            f.seek(offset)
            said[rank] = f.read()
        assert "worker stopped cleanly" in said[rank], said[rank]
    assert "stopping: received SIGTERM" in said[1], said[1]
    assert "stopping: asked by another rank" in said[0], said[0]
    await eventually(lambda: group.relaunch_count == relaunches + 1, timeout_s=60)
    await eventually(lambda: len(launcher.worker_pids()) == WORLD, timeout_s=120)


@on_module_loop
async def test_stop_mid_round_exits_cleanly_and_leaves_no_process(started: Started) -> None:
    group, launcher, workdir = started.group, started.launcher, started.workdir
    base = save_state(workdir / "slow-base.pt", TinyTask().build_model().state_dict())
    slow = instruction("slow", 0, base, inner_steps=100_000, task_options={"step_delay_s": 0.01})
    round_task = asyncio.create_task(group.run_round(slow, 120))
    handoff = HandoffDir(workdir)
    await wait_for_progress(handoff, "slow", 0, steps=3)
    assert launcher.pid is not None
    processes = descendants([launcher.pid])
    assert len(processes) >= 1 + WORLD

    began = time.monotonic()
    status = await group.stop()
    assert time.monotonic() - began < 10.0
    assert status == 0  # every worker exited 0
    assert [pid for pid in processes if alive(pid)] == []
    with pytest.raises(WorkerGroupNotRunning):
        await round_task
    assert handoff.read_done("slow", 0) is None
    for rank in range(WORLD):
        assert "worker stopped cleanly" in handoff.rank_log_path(rank).read_text()


# -- configuration and supervision logic, without processes ------------------------------


def test_launcher_command_and_environment(tmp_path: Path) -> None:
    launcher = LocalElasticLauncher(
        tmp_path, launcher_config(env={"GLOO_SOCKET_IFNAME": "lo", "NCCL_IB_HCA": "mlx5"})
    )
    command = launcher.command(port=29123, launch_id="abc")
    # A gloo group: its ranks are forked from a launcher that has imported them.
    assert command[1:3] == ["-m", "regional_agent.launch.forking_run"]
    assert "--rdzv-endpoint=127.0.0.1:29123" in command
    assert "--nproc-per-node=2" in command
    assert "--max-restarts=2" in command
    worker_args = command[command.index("regional_agent.worker.rank") + 1 :]
    settings = WorkerSettings.from_argv(worker_args)
    assert settings == launcher.settings
    assert settings.workdir == tmp_path.resolve()
    env = launcher.environment("abc")
    assert env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["NCCL_IB_HCA"] == "mlx5"
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["GEOFED_LAUNCH_ID"] == "abc"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"env": {"OMP_NUM_THREADS": "4"}}, "env may not set OMP_NUM_THREADS"),
        ({"nproc_per_node": 0}, "nproc_per_node must be an integer >= 1"),
        ({"max_restarts": -1}, "max_restarts must be >= 0"),
        ({"backend": "mpi"}, "backend must be one of"),
        ({"poll_interval_s": 0.0}, "poll_interval_s must be a positive number"),
    ],
)
def test_launcher_rejects_bad_settings(
    tmp_path: Path, overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(LauncherConfigError, match=message):
        LocalElasticLauncher(tmp_path, launcher_config(**overrides))


def test_nccl_refuses_more_ranks_than_gpus(tmp_path: Path) -> None:
    too_many = torch.cuda.device_count() + 1
    with pytest.raises(LauncherConfigError, match="NCCL refuses two ranks on one GPU"):
        LocalElasticLauncher(tmp_path, launcher_config(backend="nccl", nproc_per_node=too_many))


def test_start_kills_a_group_left_running_by_a_previous_supervisor(tmp_path: Path) -> None:
    workdir = tmp_path.resolve()
    sleeper = "import time; time.sleep(120)"
    # Stand-ins for the processes of an earlier launch: only their command lines matter.
    stale_launcher = stand_in(sys.executable, "-c", sleeper, "torch.distributed.run", str(workdir))
    stale_worker = stand_in(
        sys.executable, "-c", sleeper, "regional_agent.worker.rank", "--workdir", str(workdir)
    )
    bystander = stand_in(sys.executable, "-c", sleeper, "regional_agent.worker.rank")
    try:
        handoff = HandoffDir(workdir)
        (workdir / "launcher.pid").write_text(f"{stale_launcher.pid} old-launch\n")
        handoff.write_rank_status(
            RankStatus(0, 0, 2, stale_worker.pid, "old-launch", 0, "gloo", "cpu", "ready")
        )
        handoff.write_rank_status(
            RankStatus(1, 1, 2, bystander.pid, "old-launch", 0, "gloo", "cpu", "ready")
        )
        launcher = LocalElasticLauncher(workdir, launcher_config())
        launcher.start()
        launcher.kill()
        assert not alive(stale_launcher.pid)
        assert not alive(stale_worker.pid)
        assert alive(bystander.pid)  # not a worker of this work dir: left alone
        assert not (workdir / "launcher.pid").exists()
    finally:
        for proc in (stale_launcher, stale_worker, bystander):
            proc.kill()
            proc.wait()


class CrashingLauncherFake(Launcher):
    """Fake of the process launcher (the outer edge): ``ready`` of its 2 ranks come up,
    then it exits 1 after ``lives_s``."""

    def __init__(self, workdir: Path, lives_s: float, ready: int = 2) -> None:
        self._handoff = HandoffDir(workdir)
        self._lives_s = lives_s
        self._ready = ready
        self._started_at: float | None = None
        self._launches = 0
        self.kills = 0

    def start(self) -> None:
        self._launches += 1
        self._started_at = time.monotonic()
        for rank in range(self._ready):
            self._handoff.write_rank_status(
                RankStatus(rank, rank, 2, 1, self.launch_id or "", 0, "gloo", "cpu", "ready")
            )
        self._handoff.log_dir.mkdir(parents=True, exist_ok=True)
        self._handoff.rank_log_path(1).write_text(f"Traceback: boom in launch {self._launches}\n")

    def poll(self) -> int | None:
        if self._started_at is None:
            return None
        return 1 if time.monotonic() - self._started_at >= self._lives_s else None

    def terminate(self) -> None:
        self._started_at = None

    def kill(self) -> None:
        self.kills += 1

    @property
    def pid(self) -> int | None:
        return None

    @property
    def launch_id(self) -> str | None:
        return f"fake-{self._launches}"

    @property
    def world_size(self) -> int:
        return 2

    @property
    def restart_count(self) -> int:
        return 0


@on_module_loop
async def test_crash_loop_backs_off_then_fails_with_the_log_tail(tmp_path: Path) -> None:
    delays: list[float] = []

    async def record_sleep(seconds: float) -> None:
        delays.append(seconds)

    launcher = CrashingLauncherFake(tmp_path, lives_s=0.05)
    config = WorkerGroupConfig(
        poll_interval_s=0.01, max_relaunches=3, backoff=Backoff(initial_s=1.0, max_s=3.0, jitter=0)
    )
    group = WorkerGroup(tmp_path, launcher, config, rng=random.Random(0), sleep=record_sleep)
    await group.start()
    base = save_state(tmp_path / "base.pt", TinyTask().build_model().state_dict())
    with pytest.raises(WorkerGroupFailed, match="boom in launch 4") as failure:
        await group.run_round(instruction("job", 0, base), 10)
    assert "3 consecutive relaunches" in str(failure.value)
    assert delays == [1.0, 2.0, 3.0]
    assert group.restart_count == group.relaunch_count == 3
    await group.stop()


@on_module_loop
async def test_a_group_not_ready_in_time_is_stopped_and_logs_the_workers_output(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    launcher = CrashingLauncherFake(tmp_path, lives_s=3600, ready=1)  # rank 1 never joins
    config = WorkerGroupConfig(poll_interval_s=0.01, start_timeout_s=0.2, stop_timeout_s=0.2)
    group = WorkerGroup(tmp_path, launcher, config)
    with pytest.raises(Timeout, match=r"worker group start timed out after 0\.2 s"):
        await group.start()
    assert not group.running
    assert "not every rank was ready" in caplog.text
    assert "boom in launch 1" in caplog.text  # the ranks' last output, where they stood


@on_module_loop
async def test_round_failed_carries_the_workers_reason(tmp_path: Path) -> None:
    launcher = CrashingLauncherFake(tmp_path, lives_s=3600)
    group = WorkerGroup(tmp_path, launcher, WorkerGroupConfig(poll_interval_s=0.01))
    await group.start()
    handoff = HandoffDir(tmp_path)

    async def answered(round_: int, message: str, *, refused: bool) -> None:
        """Round ``round_`` as the workers answer it with an error marker."""
        running = asyncio.create_task(
            group.run_round(instruction("job", round_, tmp_path / "missing.pt"), 5)
        )
        await eventually(lambda: handoff.pending_instruction() == ("job", round_), 5)
        handoff.write_error("job", round_, message, refused=refused)
        await running

    with pytest.raises(RoundFailed, match=r"round 0 of job job: rank 0: FileNotFoundError") as ei:
        await answered(0, "rank 0: FileNotFoundError: missing.pt", refused=False)
    assert not isinstance(ei.value, RoundRefused)
    # Declined by the workers (the task's files differ): the agent's own refusal.
    with pytest.raises(RoundRefused, match=r"round 1 of job job: rank 0: TaskFilesDiffer"):
        await answered(1, "rank 0: TaskFilesDiffer: ...", refused=True)
    await group.stop()
