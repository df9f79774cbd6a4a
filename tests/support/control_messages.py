"""A fully populated round announcement, as the coordinator sends one, and its constants.

Shared by the wire-format tests (``tests/unit/test_control_messages.py``) and the
control-plane integration tests.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from geofed.codec_params import CodecParams
from geofed.control import RoundAnnouncement
from geofed.evaluation_config import EvaluationConfig
from geofed.training_config import LrSchedule, TrainingConfig

HASH = "ab" * 32
T0 = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)


def announcement(**overrides: Any) -> RoundAnnouncement:
    """Round 3 of job ``llm-7`` for two regions, every field set; ``overrides`` replace fields."""
    fields: dict[str, Any] = {
        "job": "llm-7",
        "round": 3,
        "base_round": 3,
        "base_hash": HASH,
        "update_url": "/v1/jobs/llm-7/rounds/2/update",
        "update_digest": "cd" * 32,
        "participants": ("eu-west", "us-east"),
        "min_regions": 1,
        "deadline": T0 + timedelta(minutes=5),
        "deadline_s": 300.0,
        "inner_steps": 500,
        "codec": CodecParams(scheme="int4", block_size=64, zstd_level=3),
        "task": "geofed.examples.tinylm:TinyLM",
        "task_options": {"vocab": 64, "layers": [1, 2], "name": None},
        "seed": 42,
        "state": "open",
        "training": TrainingConfig(
            parallelism="fsdp",
            precision="bf16",
            grad_clip_norm=1.0,
            grad_accumulation=2,
            activation_checkpointing=True,
            lr_schedule=LrSchedule(kind="warmup_cosine", warmup_steps=100, min_lr_ratio=0.1),
        ),
        "total_rounds": 20,
        "evaluation": EvaluationConfig(where="regions", every=2),
        "regions": ("ap-south", "eu-west", "us-east"),
    }
    fields.update(overrides)
    return RoundAnnouncement(**fields)
