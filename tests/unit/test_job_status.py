"""The job status JSON, rendered from the engine's facts."""

from __future__ import annotations

from typing import Any

from coordinator.jobs.status import job_status
from coordinator.rounds.quarantine import Quarantine
from coordinator.rounds.records import JobState, RoundRecord
from coordinator.rounds.state import RoundConfig, RoundState

T0 = 1_700_000_000.0  # 2023-11-14T22:13:20+00:00


def facts(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "job": "llm",
        "state": JobState.RUNNING,
        "version": 0,
        "rounds": 20,
        "regions": {"eu-west": ("news",), "us-east": ("web", "books")},
        "params_hash": None,
        "location": "eu-store",
        "val_loss": None,
        "val_history": {},
        "error": "",
        "quarantined": {},
        "record": None,
    }
    base.update(overrides)
    return base


def test_a_job_before_its_first_round() -> None:
    assert job_status(**facts()) == {
        "job": "llm",
        "state": "running",
        "round": 0,
        "rounds": 20,
        "params_hash": None,
        "checkpoint_location": "eu-store",
        "regions": {"eu-west": ["news"], "us-east": ["web", "books"]},
        "global_val_loss": None,
        "error": None,
        "evaluation": None,
        "val_loss_history": [],
        "quarantined": {},
    }


def test_a_job_collecting_a_round() -> None:
    config = RoundConfig(
        round=3, participants=("us-east", "eu-west"), min_regions=1, opened_at=T0, deadline_s=60
    )
    state = RoundState.open(config)
    state.on_delta("us-east", 3, T0 + 5)
    state.merge("eu-west", 2, T0 + 6)  # its delta for round 2, late
    record = RoundRecord(
        state=state,
        attempt=2,
        failures=1,
        deadline_reason="initial deadline 60 s",
        quarantine=Quarantine(),
    )
    body = job_status(
        **facts(
            state=JobState.PAUSED,
            version=3,
            params_hash="ab" * 32,
            val_loss=(3, 1.5),
            val_history={3: 1.5, 1: 2.5, 2: 2.0},
            error="publication of round 2 failed",
            quarantined={"eu-west": "2 missed rounds"},
            record=record,
        )
    )
    assert body["state"] == "paused"
    assert body["round"] == 3
    assert body["params_hash"] == "ab" * 32
    assert body["global_val_loss"] == {"round": 3, "value": 1.5}
    assert body["val_loss_history"] == [
        {"round": 1, "value": 2.5},
        {"round": 2, "value": 2.0},
        {"round": 3, "value": 1.5},
    ]
    assert body["error"] == "publication of round 2 failed"
    assert body["quarantined"] == {"eu-west": "2 missed rounds"}
    assert body["current"] == {
        "round": 3,
        "phase": "collecting",
        "attempt": 2,
        "participants": ["eu-west", "us-east"],
        "delivered": ["us-east"],
        "merged": [{"region": "eu-west", "round": 2}],
        "min_regions": 1,
        "grace_s": None,
        "deadline": "2023-11-14T22:14:20+00:00",
        "deadline_reason": "initial deadline 60 s",
        "end_reason": None,
        "shards": None,  # a round config recorded without shard slots
    }


def test_an_ended_round_says_why() -> None:
    config = RoundConfig(
        round=0, participants=("eu-west",), min_regions=1, opened_at=T0, deadline_s=60
    )
    state = RoundState.open(config)
    state.abandon(T0 + 1, "job cancelled by an operator")
    record = RoundRecord(
        state=state, attempt=1, failures=0, deadline_reason="", quarantine=Quarantine()
    )
    body = job_status(**facts(state=JobState.CANCELLED, record=record))
    assert body["current"]["phase"] == "abandoned"
    assert body["current"]["end_reason"] == "job cancelled by an operator"


def test_a_round_shows_the_data_shard_slots_it_opened_with() -> None:
    config = RoundConfig(
        round=4,
        participants=("eu-west", "us-east"),
        min_regions=2,
        opened_at=T0,
        deadline_s=60,
        shards={"eu-west": 0, "us-east": 2},
        shard_count=3,
    )
    record = RoundRecord(
        state=RoundState.open(config),
        attempt=1,
        failures=0,
        deadline_reason="initial deadline 60 s",
        quarantine=Quarantine(),
    )
    body = job_status(**facts(state=JobState.RUNNING, version=4, record=record))
    assert body["current"]["shards"] == {"eu-west": 0, "us-east": 2}
