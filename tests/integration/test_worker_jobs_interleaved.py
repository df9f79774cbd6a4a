"""Jobs sharing a region's worker group (2 gloo ranks, real processes) keep their own
regional state: a job trains the same parameters, round by round, whether it has the
group to itself or takes turns with another job; and a checkpoint left at the old
one-per-region place is moved to its job's and resumed from."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from geofed.training_config import LrSchedule, TrainingConfig
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.messages import RegionalCheckpoint, RoundResult
from regional_agent.launch.launcher import LocalElasticLauncher
from regional_agent.launch.worker_group import WorkerGroup, WorkerGroupConfig
from regional_agent.worker.optimizer_checkpoint import read_optimizer_state
from tests.support.tiny_task import TinyTask
from tests.support.worker_group import instruction, launcher_config, save_state

pytestmark = pytest.mark.integration
on_module_loop = pytest.mark.asyncio(loop_scope="module")

ROUNDS = 3
STEPS = 4
ACCUMULATION = 2
# A decaying schedule, accumulation and AdamW: a job that lost its optimizer state, its
# place in the schedule or its data cursor between rounds trains different parameters.
ALPHA = TrainingConfig(
    grad_accumulation=ACCUMULATION,
    lr_schedule=LrSchedule(kind="warmup_cosine", warmup_steps=2, min_lr_ratio=0.1),
)
BETA = TrainingConfig()
LEGACY_CURSOR = 40


@dataclass(frozen=True)
class JobSpec:
    name: str
    training: TrainingConfig
    seed: int
    task_options: dict[str, float]


@dataclass
class Region:
    workdir: Path
    handoff: HandoffDir
    group: WorkerGroup
    base0: Path

    async def train(self, job: JobSpec, round_: int, base: Path) -> RoundResult:
        step = instruction(
            job.name,
            round_,
            base,
            inner_steps=STEPS,
            seed=job.seed,
            task_options=job.task_options,
            training=job.training,
            total_steps=ROUNDS * STEPS,
        )
        return await self.group.run_round(step, 60)

    def next_base(self, job: JobSpec, result: RoundResult) -> Path:
        """The job's θ of the next round: here the region's own result (one region)."""
        path = self.workdir / f"{job.name}-theta-{result.summary.round + 1}.pt"
        return save_state(path, result.params)

    def rank0_log(self) -> str:
        return self.handoff.rank_log_path(0).read_text()


def legacy_checkpoint(handoff: HandoffDir) -> None:
    """Job ``old``'s state at the old single-file place, as a group of before wrote it."""
    task = TinyTask()
    model = task.build_model(seed=7)
    optimizer = task.build_optimizer(model.parameters())
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.ones(4, 8)).pow(2).sum().backward()
        optimizer.step()
    ckpt = RegionalCheckpoint("old", 1, LEGACY_CURSOR, 2, optimizer.state_dict())
    body = {"format": 1, **{name: getattr(ckpt, name) for name in ckpt.__dataclass_fields__}}
    handoff.root.mkdir(parents=True, exist_ok=True)
    torch.save(body, handoff.legacy_checkpoint_path)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def region(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Region]:
    workdir = tmp_path_factory.mktemp("shared-region")
    handoff = HandoffDir(workdir)
    legacy_checkpoint(handoff)
    # The production cadence: a job's optimizer state is saved when it is parked.
    launcher = LocalElasticLauncher(workdir, launcher_config(regional_checkpoint_every=4))
    group = WorkerGroup(workdir, launcher, WorkerGroupConfig(start_timeout_s=120.0))
    base0 = save_state(workdir / "theta0.pt", TinyTask().build_model(seed=3).state_dict())
    await group.start()
    yield Region(workdir, handoff, group, base0)
    await group.stop()


ALPHA_JOB = JobSpec("alpha", ALPHA, seed=7, task_options={})
BETA_JOB = JobSpec("beta", BETA, seed=11, task_options={"lr": 0.05})


@on_module_loop
async def test_a_job_trains_the_same_parameters_alone_and_sharing_its_region(
    region: Region,
) -> None:
    alone: list[RoundResult] = []
    base = region.base0
    for round_ in range(ROUNDS):
        alone.append(await region.train(ALPHA_JOB, round_, base))
        base = region.next_base(ALPHA_JOB, alone[-1])
    # The job ends; a job of the same name trains again, now taking turns with beta.
    region.handoff.forget_job("alpha")
    assert not region.handoff.has_checkpoint("alpha")

    shared: list[RoundResult] = []
    bases = {"alpha": region.base0, "beta": region.base0}
    for round_ in range(ROUNDS):
        for job in (ALPHA_JOB, BETA_JOB):
            result = await region.train(job, round_, bases[job.name])
            bases[job.name] = region.next_base(job, result)
            if job is ALPHA_JOB:
                shared.append(result)

    assert [r.summary.params_hash for r in shared] == [r.summary.params_hash for r in alone]
    for together, by_itself in zip(shared, alone, strict=True):
        for name, tensor in by_itself.params.items():
            assert torch.equal(together.params[name], tensor), name
        assert together.summary.cursor == by_itself.summary.cursor
    assert [r.summary.cursor for r in shared] == [
        (r + 1) * STEPS * ACCUMULATION for r in range(ROUNDS)
    ]
    # Each job's state is its own checkpoint on disk.
    alpha, beta = region.handoff.read_checkpoint("alpha"), region.handoff.read_checkpoint("beta")
    assert alpha is not None
    assert beta is not None
    assert (alpha.last_round, alpha.cursor) == (ROUNDS - 1, ROUNDS * STEPS * ACCUMULATION)
    assert (beta.last_round, beta.cursor) == (ROUNDS - 1, ROUNDS * STEPS)
    # Saved when parked for the other job, not on the cadence: nothing of it is lost.
    # Beta, trained last and still held, keeps the state it saved when parked before.
    assert (alpha.optimizer_round, beta.optimizer_round) == (ROUNDS - 1, ROUNDS - 2)
    alpha_optimizer = read_optimizer_state(region.handoff, "alpha")
    assert alpha_optimizer is not None
    assert alpha_optimizer["state"]["0.weight"]["step"].item() == ROUNDS * STEPS
    log = region.rank0_log()
    # Fresh once per life of alpha (alone, then again after it was forgotten); every
    # other turn resumed from its own checkpoint.
    assert log.count("job alpha: fresh regional state") == 2
    assert log.count("job beta: fresh regional state") == 1
    assert log.count("job alpha: parked at its regional checkpoint") == ROUNDS
    assert log.count("job beta: parked at its regional checkpoint") == ROUNDS - 1


@on_module_loop
async def test_a_legacy_checkpoint_is_moved_to_its_job_and_resumed_from(region: Region) -> None:
    assert not region.handoff.legacy_checkpoint_path.exists()
    assert "moved the legacy regional checkpoint to job old's place" in region.rank0_log()
    job = JobSpec("old", BETA, seed=7, task_options={})
    result = await region.train(job, 2, region.base0)
    assert result.summary.cursor == LEGACY_CURSOR + STEPS
    checkpoint = region.handoff.read_checkpoint("old")
    assert checkpoint is not None
    assert (checkpoint.last_round, checkpoint.cursor) == (2, LEGACY_CURSOR + STEPS)
    old_optimizer = read_optimizer_state(region.handoff, "old")
    assert old_optimizer is not None
    assert old_optimizer["state"]["0.weight"]["step"].item() == 3 + STEPS
    assert "job old: resumed from the regional checkpoint of round 1" in region.rank0_log()
