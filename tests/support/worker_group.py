"""Driving a real worker group in tests: launcher settings, instructions, base files.

Shared by the integration tests that start ``torch.distributed.run`` groups of gloo
ranks over a hand-off directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from geofed.training_config import TrainingConfig
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.messages import RoundInstruction
from regional_agent.launch.launcher import LocalElasticLauncher, LocalLauncherConfig
from regional_agent.launch.worker_group import WorkerGroup, WorkerGroupConfig
from tests.support.tiny_task import SPEC, TinyTask
from tests.support.waiting import eventually

REPO_ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
STEPS = 20


def launcher_config(**overrides: object) -> LocalLauncherConfig:
    """A 2-rank gloo group that polls fast and runs from the repository, saving the inner
    optimizer state every round (so a killed group redoes its round exactly)."""
    settings: dict[str, object] = {
        "nproc_per_node": WORLD,
        "max_restarts": 2,
        "backend": "gloo",
        "env": {"PYTHONPATH": str(REPO_ROOT)},
        "poll_interval_s": 0.02,
        "progress_interval_s": 0.05,
        "collective_timeout_s": 60.0,
        "regional_checkpoint_every": 1,
        "shutdown_timeout_s": 10,
        "cwd": REPO_ROOT,
    }
    settings.update(overrides)
    return LocalLauncherConfig(**settings)  # type: ignore[arg-type]


def instruction(job: str, round_: int, base: Path, **overrides: object) -> RoundInstruction:
    """Round ``round_`` of ``job`` on the tiny task from ``base``, as region 0 of 2."""
    fields: dict[str, object] = {
        "job": job,
        "round": round_,
        "base_params": str(base),
        "inner_steps": STEPS,
        "task": SPEC,
        "task_options": {},
        "seed": 7,
        "region": "eu-west",
        "region_index": 0,
        "num_regions": 2,
    }
    fields.update(overrides)
    return RoundInstruction(**fields)  # type: ignore[arg-type]


def save_state(path: Path, state: dict[str, torch.Tensor]) -> Path:
    torch.save(state, path)
    return path


async def wait_for_progress(
    handoff: HandoffDir, job: str, round_: int, steps: int, timeout_s: float = 30.0
) -> None:
    """Wait until rank 0 reports ``steps`` steps of the round done."""

    def done() -> bool:
        progress = handoff.read_progress(job, round_)
        return progress is not None and progress.steps_done >= steps

    try:
        await eventually(done, timeout_s)
    except TimeoutError:
        pytest.fail(f"{handoff.root}: round {round_} of job {job!r} never got to step {steps}")


def simulate_region(
    theta0: dict[str, torch.Tensor], rounds: int, world: int = WORLD, seed: int = 7
) -> list[dict[str, torch.Tensor]]:
    """What ``world`` DDP ranks compute on the tiny task, replayed in this process: each
    round from ``theta0`` with a warm optimizer, the mean gradient of the ranks' batches."""
    from geofed.task import DataShard
    from tests.support.tiny_task import TinyTask

    task = TinyTask()
    model = task.build_model()
    optimizer = task.build_optimizer(model.parameters())
    results = []
    cursor = 0
    for _ in range(rounds):
        model.load_state_dict(theta0)
        for step in range(cursor, cursor + STEPS):
            grads = []
            for rank in range(world):
                shard = DataShard("eu-west", 0, 2, rank, world, seed)
                model.zero_grad(set_to_none=True)
                task.loss(model, task.batch_at(shard, step)).backward()
                grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            for param, *per_rank in zip(model.parameters(), *grads, strict=True):
                param.grad = sum(per_rank) / world
            optimizer.step()
        cursor += STEPS
        results.append({k: v.clone() for k, v in model.state_dict().items()})
    return results


class DelayedRegion:
    """A 2-rank gloo group over ``workdir`` on the tiny task, θ_0 beside it, and the first
    round of a delayed job of ``steps`` inner steps (the overlap tests' common ground)."""

    def __init__(self, workdir: Path, steps: int) -> None:
        self.workdir = workdir
        self.steps = steps
        self.handoff = HandoffDir(workdir)
        launcher = LocalElasticLauncher(workdir, launcher_config())
        self.group = WorkerGroup(workdir, launcher, WorkerGroupConfig(start_timeout_s=120.0))
        self.base0 = save_state(workdir / "theta0.pt", TinyTask().build_model(seed=3).state_dict())

    def first(self, job: str, training: TrainingConfig) -> RoundInstruction:
        return instruction(
            job, 0, self.base0, inner_steps=self.steps, training=training, overlap="delayed"
        )
