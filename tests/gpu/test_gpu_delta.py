"""The round's delta leaves the GPU quantized: the production path, with NCCL ranks.

The agent asks for the delta (``DeltaRequest``), as it does in every federated round, and
the test plays the agent's side (it keeps ``feedback.pt`` as the agent's state does).
Under DDP in fp32 and FSDP2 in bf16, two rounds each of the llama ``tiny`` preset; what
is checked holds whatever the kernels' rounding: the delta passes the agent's own checks
(``check_worker_delta`` against θ), decodes to finite values of every tensor,
each residual value lies within two quantization steps of its tensor's largest block
(error feedback keeps only what rounding lost), the second round carries the first's
residual, and rank 0 hands over no parameters.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import pytest
import torch

from geofed.codec_params import CodecParams
from geofed.params import parameters_vector_hash
from geofed.training_config import TrainingConfig
from regional_agent.handoff.messages import DeltaRequest, RoundResult
from regional_agent.handoff.residual_file import Residual, read_residual
from regional_agent.rounds.delta import check_worker_delta
from tests.support.gpu import llama_instruction, nccl_group, require_cuda, save_theta0

SEQ_LEN, BATCH = 128, 8
OPTIONS = {"preset": "tiny", "seq_len": SEQ_LEN, "batch_size": BATCH, "val_batches": 1}
STEPS = 10
CODEC = CodecParams(scheme="int8")
CONFIGS = {
    "delta-ddp-fp32": TrainingConfig(),
    "delta-fsdp-bf16": TrainingConfig.model_validate(
        {"parallelism": "fsdp", "precision": "bf16", "grad_clip_norm": 1.0}
    ),
}


def accept(result: RoundResult, feedback: Path) -> None:
    """What the agent does once the coordinator took the delta: keep its residual."""
    assert result.residual is not None
    feedback.parent.mkdir(parents=True, exist_ok=True)
    spooled = feedback.with_name("spooled.pt")
    os.link(result.residual, spooled)
    spooled.replace(feedback)


def check_delta(
    result: RoundResult, theta: dict[str, torch.Tensor], previous: dict[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """The checks of the module docstring; the residual the round leaves."""
    assert result.params == {}
    assert result.delta is not None
    assert result.residual is not None
    check_worker_delta(theta, result.delta, CODEC)  # raises on anything the agent refuses
    decoded = result.delta.decode()
    residual = read_residual(result.residual)
    assert isinstance(residual, Residual)
    assert residual.round == result.summary.round
    assert set(decoded) == set(theta) == set(residual.tensors)
    for name, values in decoded.items():
        assert torch.isfinite(values).all(), name
        # Rounding (stochastic or not) and a bf16 scale lose at most about a step.
        step = values.abs().max().item() / 127
        assert residual.tensors[name].abs().max().item() <= 2 * step, name
    if previous is not None:  # the first round's residual was carried into the second
        assert any(not torch.equal(previous[k], residual.tensors[k]) for k in previous)
    return dict(residual.tensors)


@pytest.mark.timeout(900)
async def test_the_delta_is_quantized_on_the_gpu_under_ddp_and_fsdp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpus = require_cuda()
    base = tmp_path / "theta0.pt"
    theta0 = save_theta0(OPTIONS, base)
    async with nccl_group(tmp_path / "region") as group:
        for job, training in CONFIGS.items():
            feedback = tmp_path / "agent" / job / "feedback.pt"
            request = DeltaRequest(CODEC, str(feedback))
            residual: dict[str, torch.Tensor] | None = None
            for round_ in (0, 1):
                step = llama_instruction(job, round_, base, OPTIONS, training, STEPS)
                result = await group.run_round(dataclasses.replace(step, delta=request), 300)
                summary = result.summary
                with capsys.disabled():
                    print(f"\n{job} round {round_} on {gpus} GPU(s): {summary.stats}")
                assert summary.world_size == gpus
                assert summary.base_params_hash == parameters_vector_hash(theta0)
                assert math.isfinite(summary.mean_loss)
                residual = check_delta(result, theta0, residual)
                accept(result, feedback)
