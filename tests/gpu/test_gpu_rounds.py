"""NCCL rounds through the real worker group on the GPU(s): DDP in fp32, FSDP2 in bf16.

One rank per visible GPU (``workers.count: auto``); each configuration trains two rounds
of the llama ``tiny`` preset and publishes fp32 parameters, with the round's CUDA
figures (device, peak memory) in its summary.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from geofed.params import parameters_vector_hash
from geofed.training_config import TrainingConfig
from tests.support.gpu import llama_instruction, nccl_group, require_cuda, save_theta0

SEQ_LEN, BATCH = 128, 8
OPTIONS = {"preset": "tiny", "seq_len": SEQ_LEN, "batch_size": BATCH, "val_batches": 1}
STEPS = 20
CONFIGS = {
    "ddp-fp32": TrainingConfig(),
    "fsdp-bf16": TrainingConfig.model_validate(
        {"parallelism": "fsdp", "precision": "bf16", "grad_clip_norm": 1.0}
    ),
}


@pytest.mark.timeout(900)
async def test_nccl_rounds_under_ddp_fp32_and_fsdp_bf16(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpus = require_cuda()
    base = tmp_path / "theta0.pt"
    theta0 = save_theta0(OPTIONS, base)

    results = {}
    async with nccl_group(tmp_path / "region") as group:
        for job, training in CONFIGS.items():
            results[job] = [
                await group.run_round(
                    llama_instruction(job, round_, base, OPTIONS, training, STEPS), 300
                )
                for round_ in (0, 1)
            ]

    for job, rounds in results.items():
        for result in rounds:
            summary, stats = result.summary, result.summary.stats
            with capsys.disabled():
                print(f"\n{job} round {summary.round} on {gpus} GPU(s): {stats}")
            assert summary.world_size == gpus
            assert summary.tokens == STEPS * gpus * BATCH * SEQ_LEN
            assert math.isfinite(summary.mean_loss)
            assert summary.mean_loss < math.log(256) + 0.5
            assert set(result.params) == set(theta0)
            assert {t.dtype for t in result.params.values()} == {torch.float32}
            assert all(torch.isfinite(t).all() for t in result.params.values())
            assert summary.base_params_hash == parameters_vector_hash(theta0)
            assert summary.params_hash == parameters_vector_hash(result.params)
            assert any(not torch.equal(result.params[k], theta0[k]) for k in theta0)
            assert stats is not None
            assert stats.accelerator is not None
            assert stats.peak_memory_bytes is not None
            assert stats.peak_memory_bytes > 0
            assert stats.tokens_per_second > 0
            # The collectives are timed with CUDA events under DDP and FSDP alike (a
            # group of one GPU may issue none).
            assert stats.comm_seconds is not None
            assert 0 <= stats.comm_seconds < stats.step_seconds * STEPS
            assert stats.comm_seconds > 0 or gpus == 1
            assert all(t.busy_seconds is not None for t in stats.ranks)
