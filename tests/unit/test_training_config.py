"""The training section: defaults, strict values, unknown keys refused, its JSON form."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from geofed.training_config import LrSchedule, TrainingConfig, is_sharded


def test_defaults_train_as_before() -> None:
    config = TrainingConfig()
    assert (config.parallelism, config.precision) == ("ddp", "fp32")
    assert config.grad_clip_norm is None
    assert (config.grad_accumulation, config.activation_checkpointing) == (1, False)
    assert config.lr_schedule == LrSchedule(kind="constant", warmup_steps=0, min_lr_ratio=0.0)


def test_the_json_form_round_trips() -> None:
    config = TrainingConfig(
        parallelism="fsdp",
        precision="bf16",
        grad_clip_norm=1,
        grad_accumulation=8,
        activation_checkpointing=True,
        lr_schedule=LrSchedule(kind="warmup_cosine", warmup_steps=5, min_lr_ratio=0),
    )
    record = config.record()
    assert record == {
        "parallelism": "fsdp",
        "precision": "bf16",
        "grad_clip_norm": 1.0,
        "grad_accumulation": 8,
        "activation_checkpointing": True,
        "lr_schedule": {"kind": "warmup_cosine", "warmup_steps": 5, "min_lr_ratio": 0.0},
    }
    assert TrainingConfig.model_validate(record) == config
    assert TrainingConfig.model_validate_json(config.model_dump_json()) == config


@pytest.mark.parametrize(
    ("data", "where", "reason"),
    [
        ({"parallelism": "zero3"}, "parallelism", "'ddp', 'fsdp' or 'hsdp'"),
        ({"hsdp_shard_ranks": 2}, "", "applies to parallelism: hsdp only"),
        ({"parallelism": "hsdp", "hsdp_shard_ranks": 0}, "hsdp_shard_ranks", "greater than"),
        ({"precision": "fp16"}, "precision", "'fp32' or 'bf16'"),
        ({"grad_clip_norm": 0}, "grad_clip_norm", "greater than 0"),
        ({"grad_clip_norm": float("inf")}, "grad_clip_norm", "finite"),
        ({"grad_clip_norm": "1.0"}, "grad_clip_norm", "valid number"),
        ({"grad_accumulation": 0}, "grad_accumulation", "greater than or equal to 1"),
        ({"grad_accumulation": 2.0}, "grad_accumulation", "valid integer"),
        ({"grad_accumulation": True}, "grad_accumulation", "valid integer"),
        ({"activation_checkpointing": 1}, "activation_checkpointing", "valid boolean"),
        ({"lr_schedule": {"kind": "linear"}}, "lr_schedule.kind", "'constant' or 'warmup_cosine'"),
        (
            {"lr_schedule": {"kind": "warmup_cosine", "warmup_steps": -1}},
            "lr_schedule.warmup_steps",
            "greater than or equal to 0",
        ),
        (
            {"lr_schedule": {"kind": "warmup_cosine", "min_lr_ratio": 1.5}},
            "lr_schedule.min_lr_ratio",
            "less than or equal to 1",
        ),
        ({"lr_schedule": {"kind": "constant", "min_lr_ratio": 0.5}}, "lr_schedule", "takes no"),
        ({"lr_schedule": {"kind": "warmup_cosine", "cycles": 2}}, "lr_schedule.cycles", "Extra"),
        ({"fsdp": True}, "fsdp", "Extra inputs are not permitted"),
    ],
)
def test_bad_values_and_unknown_keys_are_refused(
    data: dict[str, Any], where: str, reason: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        TrainingConfig.model_validate(data)
    errors = caught.value.errors(include_url=False)
    assert any(".".join(map(str, e["loc"])).endswith(where) for e in errors), errors
    messages = " ".join(e["msg"] for e in errors)
    assert reason in messages, messages


def test_hsdp_shards_in_groups_and_is_a_sharded_kind() -> None:
    hsdp = TrainingConfig.model_validate({"parallelism": "hsdp", "hsdp_shard_ranks": 8})
    assert (hsdp.parallelism, hsdp.hsdp_shard_ranks) == ("hsdp", 8)
    assert TrainingConfig.model_validate({"parallelism": "hsdp"}).hsdp_shard_ranks is None
    assert [is_sharded(kind) for kind in ("ddp", "fsdp", "hsdp")] == [False, True, True]
    assert hsdp.record()["hsdp_shard_ranks"] == 8
    assert TrainingConfig.model_validate(hsdp.record()) == hsdp


def test_the_section_is_frozen() -> None:
    with pytest.raises(ValidationError):
        TrainingConfig().precision = "bf16"
