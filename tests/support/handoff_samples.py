"""A round instruction, its summary and trained parameters, and a delta's stream file, as
the hand-off tests use them."""

from __future__ import annotations

from pathlib import Path

import torch

from geofed.codec import QuantizedTensors
from regional_agent.handoff.delta_stream import DeltaStream, open_delta_stream, write_delta_stream
from regional_agent.handoff.messages import RoundInstruction, RoundSummary

INSTRUCTION = RoundInstruction(
    job="job-a",
    round=3,
    base_params="/data/base.pt",
    inner_steps=50,
    task="tests.support.tiny_task:TinyTask",
    task_options={"hidden": 8, "lr": 0.01},
    seed=1,
    region="eu-west",
    region_index=0,
    num_regions=2,
)
SUMMARY = RoundSummary(
    job="job-a",
    round=3,
    steps=50,
    tokens=400,
    mean_loss=0.25,
    cursor=200,
    base_params_hash="b" * 64,
    params_hash="p" * 64,
    world_size=2,
    train_seconds=1.5,
)
PARAMS = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}


def stream_file(path: Path, quantized: QuantizedTensors) -> DeltaStream:
    """``quantized`` sealed into a stream file at ``path``, as rank 0 hands it over."""
    return open_delta_stream(path, write_delta_stream(path, quantized))
