"""Round records survive the store, and announcements say what regions need."""

from __future__ import annotations

import json

from coordinator.rounds.quarantine import Outcome, Quarantine, QuarantineConfig
from coordinator.rounds.records import RoundRecord, announcement
from coordinator.rounds.state import RoundConfig, RoundPhase, RoundState
from geofed.codec_params import CodecParams
from geofed.control import RoundAnnouncement, decode, encode
from geofed.evaluation_config import EvaluationConfig
from geofed.training_config import LrSchedule, TrainingConfig

HASH = "ab" * 32


def _state() -> RoundState:
    config = RoundConfig(
        round=4, participants=("us-east", "eu-west"), min_regions=1, opened_at=1000.0, deadline_s=60
    )
    state = RoundState.open(config)
    state.on_delta("eu-west", 4, 1010.0)
    return state


def test_a_round_record_round_trips_through_json() -> None:
    quarantine = Quarantine(QuarantineConfig())
    quarantine.record("us-east", 3, Outcome.STRAGGLER, 900.0)
    record = RoundRecord(
        _state(), attempt=2, failures=1, deadline_reason="r", quarantine=quarantine
    )
    text = json.dumps(record.to_dict(), sort_keys=True)
    again = RoundRecord.from_dict(json.loads(text), QuarantineConfig())
    assert again.to_dict() == record.to_dict()
    assert again.state.delivered == ("eu-west",)
    assert again.state.phase is RoundPhase.COLLECTING


def _announce(**overrides: object) -> RoundAnnouncement:
    fields: dict[str, object] = {
        "job": "tiny",
        "version": 4,
        "params_hash": HASH,
        "update_digest": "cd" * 32,
        "round_state": _state(),
        "state": "open",
        "regions": ("eu-west", "us-east"),
        "quorum": 2,
        "inner_steps": 50,
        "codec": CodecParams(scheme="int4", block_size=64, zstd_level=3),
        "task": "tests.support.tiny_task:TinyTask",
        "task_options": {"hidden": 8},
        "seed": 7,
        "training": TrainingConfig(),
        "total_rounds": 20,
        "default_deadline_s": 300.0,
        "now": 2000.0,
    }
    fields.update(overrides)
    return announcement(**fields)  # type: ignore[arg-type]


def test_an_open_round_is_announced_with_its_base_and_update() -> None:
    message = decode(encode(_announce()), RoundAnnouncement)
    assert (message.round, message.base_round, message.base_hash) == (4, 4, HASH)
    assert message.update_url == "/v1/jobs/tiny/rounds/3/update"
    assert message.update_digest == "cd" * 32
    assert message.participants == ("eu-west", "us-east")
    assert (message.min_regions, message.deadline_s) == (1, 60.0)
    assert message.deadline.timestamp() == 1060.0


def test_without_an_open_round_the_jobs_regions_stand_in() -> None:
    message = _announce(round_state=None, state="paused", version=0, update_digest=None)
    assert (message.round, message.state, message.update_url) == (0, "paused", None)
    assert (message.participants, message.min_regions) == (("eu-west", "us-east"), 2)
    assert message.deadline.timestamp() == 2000.0


def test_the_announcement_carries_the_jobs_training_section_and_length() -> None:
    training = TrainingConfig(
        parallelism="fsdp",
        precision="bf16",
        lr_schedule=LrSchedule(kind="warmup_cosine", warmup_steps=10),
    )
    message = decode(encode(_announce(training=training)), RoundAnnouncement)
    assert message.training == training
    assert (message.total_rounds, message.total_steps) == (20, 1000)


def test_the_announcement_carries_the_jobs_evaluation_section() -> None:
    assert _announce().evaluation == EvaluationConfig()
    evaluation = EvaluationConfig(where="region:us-east", every=3)
    message = decode(encode(_announce(evaluation=evaluation)), RoundAnnouncement)
    assert message.evaluation == evaluation
