"""A Hugging Face model through the real worker group: two gloo ranks build a tiny Llama
on the meta device, shard it with FSDP2 in bf16 (its decoder layers as units, checkpointed),
load θ_0 (the directory's weights) and train a round on the region's JSON lines file,
tokenized once into the cache both ranks share; a round whose announced task fingerprint
is not the one the ranks compute is refused, naming both."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from coordinator.jobs.initial_build import initial_parameters
from geofed.data import DatasetLocation
from geofed.params import parameters_vector_hash
from geofed.task import load_task
from geofed.training_config import TrainingConfig
from regional_agent.handoff.messages import RoundInstruction
from regional_agent.launch.launcher import LocalElasticLauncher
from regional_agent.launch.worker_group import RoundRefused, WorkerGroup, WorkerGroupConfig
from tests.support.hf_models import save_model, save_tokenizer, stdlib_texts, write_jsonl
from tests.support.worker_group import launcher_config

pytestmark = pytest.mark.integration
on_module_loop = pytest.mark.asyncio(loop_scope="module")

SPEC = "geofed.tasks.hf:CausalLMTask"
STEPS = 3


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def group(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[WorkerGroup]:
    workdir = tmp_path_factory.mktemp("hf-region")
    launcher = LocalElasticLauncher(workdir, launcher_config(max_restarts=0))
    workers = WorkerGroup(workdir, launcher, WorkerGroupConfig(start_timeout_s=120.0))
    await workers.start()
    yield workers
    await workers.stop()


def instruction(
    job: str, model: Path, data: DatasetLocation, base: Path, fingerprint: str | None
) -> RoundInstruction:
    return RoundInstruction(
        job=job,
        round=0,
        base_params=str(base),
        inner_steps=STEPS,
        task=SPEC,
        task_options={"model": str(model), "seq_len": 16, "batch_size": 2},
        seed=5,
        region="eu-west",
        region_index=0,
        num_regions=2,
        training=TrainingConfig.model_validate(
            {"parallelism": "fsdp", "precision": "bf16", "activation_checkpointing": True}
        ),
        datasets={"eu-docs": data},
        task_fingerprint=fingerprint,
    )


@on_module_loop
async def test_a_pretrained_hf_model_trains_sharded_on_the_region_s_file(
    group: WorkerGroup, tmp_path: Path
) -> None:
    model = save_tokenizer(save_model(tmp_path / "model", "llama"))
    data = DatasetLocation(
        path=str(write_jsonl(tmp_path / "docs.jsonl", stdlib_texts(8, skip=100))),
        format="jsonl",
        cache_dir=str(tmp_path / "cache"),
    )
    task = load_task(SPEC, {"model": str(model), "seq_len": 16, "batch_size": 2})
    theta0 = initial_parameters(task, seed=5)
    base = tmp_path / "theta0.pt"
    torch.save(theta0, base)

    result = await group.run_round(
        instruction("hf", model, data, base, task.fingerprint()), timeout_s=120
    )

    assert set(result.params) == set(theta0)
    assert result.summary.base_params_hash == parameters_vector_hash(theta0)
    assert any(not torch.equal(result.params[k], theta0[k]) for k in theta0)
    assert all(torch.isfinite(t).all() for t in result.params.values())
    assert result.summary.tokens == 2 * STEPS * 2 * 16  # ranks x steps x batch x seq_len
    assert len(list((tmp_path / "cache").glob("tokens-*.bin"))) == 1
    for rank in (0, 1):
        log = group.handoff.rank_log_path(rank).read_text()
        assert "job hf: CausalLMTask: built on the meta device" in log

    announced = "0" * 64
    # Declined, not failed: the agent reports it as the region's own refusal.
    with pytest.raises(RoundRefused) as failed:
        await group.run_round(instruction("hf-other", model, data, base, announced), timeout_s=120)
    message = str(failed.value)
    assert "the task's files here are not the coordinator's" in message
    assert f"{task.fingerprint()} here, {announced} announced" in message
