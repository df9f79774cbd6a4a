"""What the GPU tests share: the CUDA device they need (asked for as a failure), and a
worker group of NCCL ranks training the llama example."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.jobs.initial_build import initial_parameters
from geofed.task import load_task
from geofed.training_config import TrainingConfig
from regional_agent.handoff.messages import RoundInstruction
from regional_agent.launch.launcher import LocalElasticLauncher
from regional_agent.launch.worker_group import WorkerGroup, WorkerGroupConfig
from tests.support.worker_group import launcher_config

LLAMA = "geofed.examples.llama:LlamaTask"


def require_cuda() -> int:
    """The number of visible CUDA devices; fails the calling test when there is none.

    A failure, not a skip: ``make test-gpu`` is run to learn how geofed does on a GPU,
    and a run that tested nothing must not pass.
    """
    if not torch.cuda.is_available():
        pytest.fail(
            "make test-gpu needs a CUDA GPU; torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}). "
            "On a machine without one, run make test.",
            pytrace=False,
        )
    return torch.cuda.device_count()


@contextlib.asynccontextmanager
async def nccl_group(workdir: Path) -> AsyncIterator[WorkerGroup]:
    """A started worker group of one NCCL rank per visible GPU (``workers.count: auto``)."""
    config = launcher_config(
        backend="nccl", nproc_per_node="auto", max_restarts=0, collective_timeout_s=300.0
    )
    group = WorkerGroup(
        workdir, LocalElasticLauncher(workdir, config), WorkerGroupConfig(start_timeout_s=300.0)
    )
    await group.start()
    try:
        yield group
    finally:
        await group.stop()


def llama_instruction(
    job: str,
    round_: int,
    base: Path,
    options: Mapping[str, Any],
    training: TrainingConfig,
    steps: int,
) -> RoundInstruction:
    """Round ``round_`` of a llama ``job`` from ``base``, as region 0 of 1."""
    return RoundInstruction(
        job=job,
        round=round_,
        base_params=str(base),
        inner_steps=steps,
        task=LLAMA,
        task_options=dict(options),
        seed=11,
        region="gpu",
        region_index=0,
        num_regions=1,
        training=training,
    )


def save_theta0(options: Mapping[str, Any], path: Path) -> dict[str, torch.Tensor]:
    """θ_0 of the llama task with ``options``, saved to ``path`` as the coordinator would."""
    theta0 = initial_parameters(load_task(LLAMA, dict(options)), seed=11)
    torch.save(theta0, path)
    return theta0
