"""θ made on the GPUs from the θ a serial round's hand-over put back and the round's
update, bit for bit what reading it whole gives (:mod:`regional_agent.worker.base_update`).

NCCL ranks, one per GPU, under DDP in fp32 and FSDP2 in bf16, the llama ``tiny`` preset.
θ_1 is θ_0 and a signed update of round 0, chained as an agent chains it. A job that ran
round 0 holds θ_0 after its hand-over and makes θ_1 on the devices (its rank 0 log says
so); a job told nothing of θ_1's hash reads it whole and hashes it; both hand over the
same delta bytes for round 1, from the same θ by its hash. The additions happen on the
GPU in float32, so this is the check that the device's arithmetic is the agent's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from geofed.codec_params import CodecParams
from geofed.params import parameters_vector_hash
from geofed.training_config import TrainingConfig
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.messages import DeltaRequest
from tests.support.global_updates import chained_theta
from tests.support.gpu import llama_instruction, nccl_group, require_cuda, save_theta0
from tests.support.pki import make_federation

OPTIONS = {"preset": "tiny", "seq_len": 128, "batch_size": 8, "val_batches": 1}
STEPS = 4
CONFIGS = {
    "ddp-fp32": TrainingConfig(),
    "fsdp-bf16": TrainingConfig.model_validate({"parallelism": "fsdp", "precision": "bf16"}),
}
MADE = "θ_1 made from the shards' θ_0 and its update"


@pytest.mark.timeout(900)
async def test_theta_made_on_the_gpus_from_the_held_theta_and_the_update_is_bit_for_bit(
    tmp_path: Path,
) -> None:
    require_cuda()
    theta0 = save_theta0(OPTIONS, tmp_path / "theta0.pt")
    chain, _, after = chained_theta(make_federation(tmp_path / "fed"), theta0, tmp_path, job="gpu")
    request = DeltaRequest(CodecParams(scheme="int8"), str(tmp_path / "no-feedback.pt"))
    workdir = tmp_path / "region"
    async with nccl_group(workdir) as group:
        for name, training in CONFIGS.items():
            deltas = {}
            for job, hashed in ((f"held-{name}", True), (f"whole-{name}", False)):
                first = llama_instruction(job, 0, tmp_path / "theta-0.st", OPTIONS, training, STEPS)
                first = dataclasses.replace(
                    first, delta=request, base_hash=parameters_vector_hash(theta0)
                )
                await group.run_round(first, 300)
                step = llama_instruction(job, 1, chain, OPTIONS, training, STEPS)
                step = dataclasses.replace(
                    step,
                    delta=request,
                    base_hash=parameters_vector_hash(after) if hashed else None,
                )
                result = await group.run_round(step, 300)
                assert result.summary.base_params_hash == parameters_vector_hash(after)
                assert result.delta is not None
                deltas[job] = result.delta.to_bytes()
            assert deltas[f"held-{name}"] == deltas[f"whole-{name}"], name
    log = HandoffDir(workdir).rank_log_path(0).read_text()
    assert log.count(MADE) == len(CONFIGS)
