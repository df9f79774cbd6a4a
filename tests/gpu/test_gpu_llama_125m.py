"""The llama ``125m`` preset trains rounds on the GPU(s) under FSDP2 in bf16.

Prints each round's tokens/s, model FLOPs utilisation (when the GPU's peak is known to
:mod:`regional_agent.handoff.flops`) and peak memory, as the worker group measured them. Each
round starts from the previous round's parameters, as if the region were alone.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from geofed.training_config import TrainingConfig
from regional_agent.handoff.flops import flops_utilisation, peak_flops
from tests.support.gpu import llama_instruction, nccl_group, require_cuda, save_theta0

OPTIONS = {"preset": "125m", "seq_len": 512, "batch_size": 8, "val_batches": 1}
ROUNDS = 3
STEPS = 20
TRAINING = TrainingConfig.model_validate(
    {"parallelism": "fsdp", "precision": "bf16", "grad_clip_norm": 1.0}
)


@pytest.mark.timeout(1200)
async def test_llama_125m_trains_rounds_and_reports_throughput(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpus = require_cuda()
    base = tmp_path / "theta0.pt"
    save_theta0(OPTIONS, base)

    summaries = []
    async with nccl_group(tmp_path / "region") as group:
        for round_ in range(ROUNDS):
            instruction = llama_instruction("llama-125m", round_, base, OPTIONS, TRAINING, STEPS)
            result = await group.run_round(instruction, 900)
            summaries.append(result.summary)
            base = tmp_path / f"theta{round_ + 1}.pt"
            torch.save(result.params, base)

    for summary in summaries:
        stats = summary.stats
        assert stats is not None
        assert stats.accelerator is not None
        assert stats.peak_memory_bytes is not None
        assert stats.peak_memory_bytes > 0
        assert stats.tokens_per_second > 0
        assert stats.flops_per_token > 0
        peak = peak_flops(stats.accelerator, "bf16")
        mfu = "n/a (peak unknown)"
        if peak is not None:
            utilisation = flops_utilisation(
                stats.tokens_per_second, stats.flops_per_token, peak, gpus
            )
            mfu = f"{utilisation:.1%}"
        with capsys.disabled():
            print(
                f"\nllama 125m fsdp bf16, {gpus} x {stats.accelerator}, round {summary.round}: "
                f"{stats.tokens_per_second:,.0f} tokens/s, MFU {mfu}, "
                f"peak memory {stats.peak_memory_bytes / 2**30:.2f} GiB, "
                f"step {stats.step_seconds * 1e3:.0f} ms, mean loss {summary.mean_loss:.3f}"
            )
        assert math.isfinite(summary.mean_loss)
    assert summaries[-1].mean_loss < summaries[0].mean_loss
