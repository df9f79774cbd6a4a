"""A round instruction, its summary and trained parameters, as the hand-off tests use them."""

from __future__ import annotations

import torch

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
