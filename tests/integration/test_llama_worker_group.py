"""A model with a complex64 persistent buffer trains through the real worker group.

The llama ``tiny`` preset registers its rotary table ``freqs_cis`` (complex64) as a
persistent buffer: θ_0 leaves it out, the ranks build the model on the meta device and
recompute the table (``init_non_federated``), train two rounds from the federated state
alone, and publish float32 parameters without it; under FSDP2 in bf16 with its blocks
checkpointed too.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from coordinator.jobs.initial_build import initial_parameters
from geofed.params import parameters_vector_hash
from geofed.task import load_task
from geofed.training_config import TrainingConfig
from regional_agent.handoff.messages import RoundInstruction
from regional_agent.launch.launcher import LocalElasticLauncher, LocalLauncherConfig
from regional_agent.launch.worker_group import WorkerGroup, WorkerGroupConfig
from regional_agent.worker.optimizer_checkpoint import read_optimizer_state

REPO_ROOT = Path(__file__).resolve().parents[2]
LLAMA = "geofed.examples.llama:LlamaTask"
OPTIONS = {"preset": "tiny", "n_layers": 2, "seq_len": 16, "batch_size": 2, "val_batches": 1}
STEPS = 3

pytestmark = pytest.mark.integration
on_module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def group(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[WorkerGroup]:
    workdir = tmp_path_factory.mktemp("llama-region")
    config = LocalLauncherConfig(
        nproc_per_node=2,
        max_restarts=0,
        backend="gloo",
        env={"PYTHONPATH": str(REPO_ROOT)},
        poll_interval_s=0.02,
        progress_interval_s=0.05,
        collective_timeout_s=60.0,
        regional_checkpoint_every=4,  # half the default: fewer rounds to cross a save
        shutdown_timeout_s=10,
        cwd=REPO_ROOT,
    )
    workers = WorkerGroup(
        workdir, LocalElasticLauncher(workdir, config), WorkerGroupConfig(start_timeout_s=120.0)
    )
    await workers.start()
    yield workers
    await workers.stop()


def _instruction(
    round_: int, base: Path, job: str = "llama", training: TrainingConfig | None = None
) -> RoundInstruction:
    return RoundInstruction(
        job=job,
        round=round_,
        base_params=str(base),
        inner_steps=STEPS,
        task=LLAMA,
        task_options=OPTIONS,
        seed=5,
        region="eu-west",
        region_index=0,
        num_regions=2,
        training=training if training is not None else TrainingConfig(),
    )


@on_module_loop
async def test_a_complex_buffer_model_trains_rounds(group: WorkerGroup, tmp_path: Path) -> None:
    task = load_task(LLAMA, OPTIONS)
    assert task.build_model(seed=5).state_dict()["freqs_cis"].dtype == torch.complex64
    theta0 = initial_parameters(task, seed=5)
    assert "freqs_cis" not in theta0
    base = tmp_path / "theta0.pt"
    torch.save(theta0, base)

    began = time.monotonic()
    first = await group.run_round(_instruction(0, base), 60)
    second = await group.run_round(_instruction(1, base), 60)
    assert time.monotonic() - began < 30

    for index, result in enumerate((first, second)):
        assert set(result.params) == set(theta0)
        assert {t.dtype for t in result.params.values()} == {torch.float32}
        assert all(torch.isfinite(t).all() for t in result.params.values())
        assert result.summary.base_params_hash == parameters_vector_hash(theta0)
        assert result.summary.params_hash == parameters_vector_hash(result.params)
        assert result.summary.cursor == STEPS * (index + 1)
        assert any(not torch.equal(result.params[k], theta0[k]) for k in theta0)
    assert first.summary.params_hash != second.summary.params_hash
    checkpoint = group.handoff.read_checkpoint("llama")
    assert checkpoint is not None
    assert (checkpoint.job, checkpoint.last_round) == ("llama", 1)
    # Every rank built the model without storage and allocated only what it holds.
    for rank in (0, 1):
        log = group.handoff.rank_log_path(rank).read_text()
        assert "job llama: LlamaTask: built on the meta device" in log


@on_module_loop
async def test_a_complex_buffer_model_trains_sharded_in_bf16(
    group: WorkerGroup, tmp_path: Path
) -> None:
    task = load_task(LLAMA, OPTIONS)
    theta0 = initial_parameters(task, seed=5)
    base = tmp_path / "theta0.pt"
    torch.save(theta0, base)
    training = TrainingConfig.model_validate(
        {"parallelism": "fsdp", "precision": "bf16", "activation_checkpointing": True}
    )

    result = await group.run_round(_instruction(0, base, "llama-fsdp", training), 60)

    assert set(result.params) == set(theta0)
    assert {t.dtype for t in result.params.values()} == {torch.float32}
    assert all(torch.isfinite(t).all() for t in result.params.values())
    assert result.summary.base_params_hash == parameters_vector_hash(theta0)
    assert result.summary.params_hash == parameters_vector_hash(result.params)
    assert any(not torch.equal(result.params[k], theta0[k]) for k in theta0)


@on_module_loop
async def test_a_group_killed_between_optimizer_saves_resumes_with_the_older_state(
    group: WorkerGroup, tmp_path: Path
) -> None:
    """At a cadence of 4 the sharded optimizer state is saved at the first round and then
    every 4; a crash in between costs the optimizer state since that save, never the data
    cursor or a round."""
    task = load_task(LLAMA, OPTIONS)
    base = tmp_path / "theta0.pt"
    torch.save(initial_parameters(task, seed=5), base)
    training = TrainingConfig.model_validate({"parallelism": "fsdp"})
    for round_ in range(3):
        await group.run_round(_instruction(round_, base, "cadence", training), 60)
    record = group.handoff.read_checkpoint("cadence")
    assert record is not None
    assert (record.last_round, record.cursor, record.optimizer_round) == (2, 3 * STEPS, 0)
    saved = sorted(p.name for p in group.handoff.job_dir("cadence").glob("optimizer-round-*"))
    assert saved == ["optimizer-round-0"]

    restarts = group.restart_count
    (rank1,) = [s for s in group.handoff.read_rank_statuses() if s.rank == 1]
    os.kill(rank1.pid, signal.SIGKILL)
    third = await group.run_round(_instruction(3, base, "cadence", training), 120)
    fourth = await group.run_round(_instruction(4, base, "cadence", training), 60)

    assert group.restart_count > restarts
    assert (third.summary.cursor, fourth.summary.cursor) == (4 * STEPS, 5 * STEPS)
    assert all(torch.isfinite(t).all() for t in fourth.params.values())
    log = group.handoff.rank_log_path(0).read_text()
    assert (
        f"job cadence: resumed from the regional checkpoint of round 2 (data step {3 * STEPS}; "
        "optimizer state of round 0)" in log
    )
    record = group.handoff.read_checkpoint("cadence")
    assert record is not None
    assert record.optimizer_round == 4  # 4 rounds after the last save
    optimizer_state = read_optimizer_state(group.handoff, "cadence")
    assert optimizer_state is not None
    # Rounds 0, 3 and 4 stepped this state; rounds 1 and 2's steps went with the crash.
    assert optimizer_state["state"]["tok_embeddings.weight"]["step"].item() == 3 * STEPS
