"""Control-plane messages: strict schemas, the wire form, de-duplication."""

from __future__ import annotations

import contextlib
import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any
from uuid import UUID, uuid4

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from geofed.control import (
    Command,
    Deduplicator,
    Event,
    MessageError,
    RegionStatus,
    RoundAnnouncement,
    decode,
    decode_any,
    encode,
)
from geofed.control.messages import MAX_PAYLOAD_BYTES
from geofed.evaluation_config import EvaluationConfig
from geofed.training_config import LrSchedule, TrainingConfig
from tests.support.control_messages import HASH, announcement


def samples() -> list[RoundAnnouncement | RegionStatus | Command | Event]:
    return [
        announcement(),
        announcement(round=0, base_round=0, update_url=None, update_digest=None),
        RegionStatus(
            region="eu-west",
            state="training",
            job="llm-7",
            round=3,
            params_hash=HASH,
            train_loss=2.5,
            worker_restarts=1,
            agent_version="0.1.0",
        ),
        RegionStatus(region="eu-west", state="offline", agent_version="0.1.0"),
        Command(action="pause", job="llm-7", reason="operator request"),
        Command(action="drain"),
        Event(kind="round.closed", job="llm-7", round=3, region="eu-west", detail="quorum 2/2"),
    ]


@pytest.mark.parametrize("message", samples(), ids=lambda m: m.type)
def test_round_trip_keeps_every_field(message: Any) -> None:
    payload = encode(message)
    assert isinstance(payload, bytes)
    assert decode(payload, type(message)) == message
    assert decode_any(payload) == message


def test_envelope_is_filled_in_for_senders() -> None:
    before = datetime.now(UTC)
    first, second = Event(kind="x"), Event(kind="x")
    assert isinstance(first.message_id, UUID)
    assert first.message_id != second.message_id
    assert first.sent_at.tzinfo is not None
    assert before <= first.sent_at <= datetime.now(UTC)
    assert json.loads(encode(first))["type"] == "event"


def test_timestamps_are_normalised_to_utc_and_naive_ones_refused() -> None:
    plus_two = timezone(timedelta(hours=2))
    message = announcement(deadline=datetime(2030, 1, 1, 12, tzinfo=plus_two))
    assert message.deadline == datetime(2030, 1, 1, 10, tzinfo=UTC)
    assert message.deadline.utcoffset() == timedelta(0)
    with pytest.raises(ValidationError, match="timezone"):
        announcement(deadline=datetime(2030, 1, 1, 12))


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"base_round": 4}, "base_round 4 is after round 3"),
        ({"update_digest": None}, "go together"),
        ({"round": 0, "base_round": 0}, "round 0 starts from the initial parameters"),
        ({"participants": ()}, "at least one region"),
        ({"participants": ("eu-west", "eu-west")}, "lists a region twice"),
        ({"min_regions": 3}, "min_regions 3 exceeds 2 participants"),
        ({"participants": ("eu/west",)}, "invalid region"),
        ({"job": "#"}, "invalid job"),
        ({"base_hash": "AB" * 32}, "pattern"),
        ({"deadline_s": 0.0}, "greater than 0"),
        ({"inner_steps": 0}, "greater than or equal to 1"),
        ({"state": "running"}, "open"),
        ({"task": "not a spec"}, "pattern"),
        ({"round": "3"}, "valid integer"),
        ({"round": 3.0}, "valid integer"),
        ({"seed": -1}, "greater than or equal to 0"),
        ({"codec": {"scheme": "int2"}}, "'fp32', 'int8' or 'int4'"),
        ({"deadline_s": float("nan")}, "finite"),
        ({"unknown": 1}, "Extra inputs are not permitted"),
        ({"total_rounds": 0}, "greater than or equal to 1"),
        ({"total_rounds": None}, "a warmup_cosine schedule needs total_rounds"),
        ({"training": {"parallelism": "zero3"}}, "'ddp', 'fsdp' or 'hsdp'"),
        ({"training": {"precison": "bf16"}}, "Extra inputs are not permitted"),
        ({"regions": ("eu-west", "eu-west", "us-east")}, "regions lists a region twice"),
        ({"regions": ("eu-west",)}, r"participants \['us-east'\] are not among"),
    ],
)
def test_announcement_refuses_inconsistent_or_loose_input(
    overrides: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ValidationError, match=reason):
        announcement(**overrides)


def test_status_and_command_rules() -> None:
    with pytest.raises(ValidationError, match="finite"):
        RegionStatus(region="eu", state="training", train_loss=float("inf"), agent_version="1")
    with pytest.raises(ValidationError, match="Input should be"):
        RegionStatus(region="eu", state="asleep", agent_version="1")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="pause command must name its job"):
        Command(action="pause")
    with pytest.raises(ValidationError, match="pattern"):
        Event(kind="Round Closed")


def wire(message: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(encode(message))
    return data


def as_payload(data: dict[str, Any]) -> bytes:
    return json.dumps(data).encode()


@pytest.mark.parametrize("field", ["type", "message_id", "sent_at"])
def test_decode_requires_the_envelope(field: str) -> None:
    data = wire(Event(kind="x"))
    del data[field]
    with pytest.raises(MessageError, match=f"lacks {field}"):
        decode(as_payload(data), Event)
    with pytest.raises(MessageError):
        decode_any(as_payload(data))


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda d: d.update(extra=1), "extra: Extra inputs are not permitted"),
        (lambda d: d.update(round="3"), "round: Input should be a valid integer"),
        (lambda d: d.update(round=True), "round: Input should be a valid integer"),
        (lambda d: d.update(sent_at="2030-01-01T00:00:00"), "sent_at: Input should have timezone"),
        (lambda d: d.update(message_id="not-a-uuid"), "message_id"),
        (lambda d: d.update(participants="eu-west"), "participants"),
        (lambda d: d["codec"].update(level=3), "codec.level: Extra inputs"),
        (lambda d: d["training"].update(grad_accumulation="2"), "training.grad_accumulation"),
        (lambda d: d["training"]["lr_schedule"].update(cycles=2), "lr_schedule.cycles: Extra"),
    ],
)
def test_decode_is_strict(mutate: Any, reason: str) -> None:
    data = wire(announcement())
    mutate(data)
    with pytest.raises(MessageError, match=reason):
        decode(as_payload(data), RoundAnnouncement)


def test_the_announcement_carries_the_training_section_and_the_jobs_length() -> None:
    message = decode(encode(announcement()), RoundAnnouncement)
    assert message.training.parallelism == "fsdp"
    assert message.training.lr_schedule == LrSchedule(
        kind="warmup_cosine", warmup_steps=100, min_lr_ratio=0.1
    )
    assert (message.total_rounds, message.total_steps) == (20, 20 * 500)
    assert wire(message)["training"] == message.training.record()


def test_an_announcement_without_training_trains_with_the_defaults() -> None:
    # Retained announcements of coordinators that did not send these fields still parse.
    data = wire(announcement())
    del data["training"], data["total_rounds"]
    message = decode(as_payload(data), RoundAnnouncement)
    assert message.training == TrainingConfig()
    assert (message.total_rounds, message.total_steps) == (None, None)
    constant = announcement(training=TrainingConfig(), total_rounds=None)
    assert decode(encode(constant), RoundAnnouncement) == constant


def test_the_announcement_carries_where_the_parameters_are_evaluated() -> None:
    message = decode(encode(announcement()), RoundAnnouncement)
    assert message.evaluation == EvaluationConfig(where="regions", every=2)
    assert wire(message)["evaluation"] == {"where": "regions", "every": 2}
    # Retained announcements of coordinators that did not send it mean the default.
    data = wire(announcement())
    del data["evaluation"]
    assert decode(as_payload(data), RoundAnnouncement).evaluation == EvaluationConfig()
    data["evaluation"] = {"where": "everywhere"}
    with pytest.raises(MessageError, match="evaluation"):
        decode(as_payload(data), RoundAnnouncement)


def test_a_regions_data_shard_is_its_place_among_the_jobs_regions() -> None:
    full = announcement(participants=("ap-south", "eu-west", "us-east"))
    # ap-south quarantined: the others keep their shards.
    without = announcement(participants=("eu-west", "us-east"))
    for region in ("eu-west", "us-east"):
        assert without.data_shard(region) == full.data_shard(region)
    assert [full.data_shard(r) for r in ("ap-south", "eu-west", "us-east")] == [
        (0, 3),
        (1, 3),
        (2, 3),
    ]
    with pytest.raises(ValueError, match="not one of the job's regions"):
        full.data_shard("sa-east")
    # Retained announcements of coordinators that did not send the list: participants.
    data = wire(without)
    del data["regions"]
    assert decode(as_payload(data), RoundAnnouncement).data_shard("us-east") == (1, 2)


def test_decode_names_the_type_when_it_is_the_wrong_message() -> None:
    payload = encode(RegionStatus(region="eu", state="online", agent_version="1"))
    with pytest.raises(
        MessageError, match="type is 'region_status', expected 'round_announcement'"
    ):
        decode(payload, RoundAnnouncement)


def test_decode_refuses_non_finite_numbers_on_the_wire() -> None:
    payload = encode(RegionStatus(region="eu", state="training", train_loss=1.0, agent_version="1"))
    for literal in (b"1e999", b"NaN", b"Infinity"):
        with pytest.raises(MessageError):
            decode(payload.replace(b'"train_loss":1.0', b'"train_loss":' + literal), RegionStatus)


def test_decode_refuses_oversized_and_non_bytes_payloads() -> None:
    big = b'{"type":"event","kind":"x","detail":"' + b"x" * MAX_PAYLOAD_BYTES + b'"}'
    with pytest.raises(MessageError, match="exceeds"):
        decode(big, Event)
    with pytest.raises(MessageError, match="must be bytes"):
        decode("{}", Event)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xff\xfe", b"null", b"[]", b"{}", b"[" * 100_000, b'{"type":"event"', b"\x00" * 10],
)
def test_garbage_raises_message_error(payload: bytes) -> None:
    with pytest.raises(MessageError):
        decode(payload, Event)
    with pytest.raises(MessageError):
        decode_any(payload)


MESSAGE_TYPES = [RoundAnnouncement, RegionStatus, Command, Event]


@settings(max_examples=300, deadline=None)
@given(payload=st.binary(max_size=512), expected=st.sampled_from(MESSAGE_TYPES))
def test_fuzz_random_bytes_only_ever_raise_message_error(payload: bytes, expected: Any) -> None:
    for parse in (lambda: decode(payload, expected), lambda: decode_any(payload)):
        with contextlib.suppress(MessageError):
            parse()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(
    index=st.integers(min_value=0, max_value=len(samples()) - 1),
    key=st.text(max_size=12) | st.sampled_from(["type", "round", "job", "sent_at", "codec"]),
    value=json_values,
    drop=st.booleans(),
)
def test_fuzz_mutated_documents_decode_or_raise_message_error(
    index: int, key: str, value: Any, drop: bool
) -> None:
    message: Any = samples()[index]
    data = wire(message)
    if drop:
        data.pop(key, None)
    else:
        data[key] = value
    payload = json.dumps(data, allow_nan=True).encode()
    try:
        decoded = decode(payload, type(message))
    except MessageError:
        return
    # Whatever is accepted is a complete, valid message that survives a round trip.
    assert decode(encode(decoded), type(message)) == decoded


def test_deduplicator_drops_repeats() -> None:
    seen = Deduplicator(capacity=3)
    a, b = uuid4(), uuid4()
    assert seen.first_time(a) is True
    assert seen.first_time(a) is False
    assert seen.first_time(b) is True
    assert a in seen
    assert b in seen
    assert len(seen) == 2


def test_deduplicator_is_bounded_and_evicts_least_recently_seen() -> None:
    seen = Deduplicator(capacity=3)
    ids = [uuid4() for _ in range(4)]
    for message_id in ids[:3]:
        seen.first_time(message_id)
    assert seen.first_time(ids[0]) is False  # a repeat refreshes ids[0]
    assert seen.first_time(ids[3]) is True  # evicts ids[1], the least recent
    assert len(seen) == 3
    assert ids[1] not in seen
    assert ids[0] in seen
    assert seen.first_time(ids[1]) is True


def test_deduplicator_with_a_redelivered_message() -> None:
    seen = Deduplicator()
    payload = encode(announcement())
    first, again = decode(payload, RoundAnnouncement), decode(payload, RoundAnnouncement)
    assert seen.first_time(first.message_id) is True
    assert seen.first_time(again.message_id) is False


def test_deduplicator_refuses_a_useless_capacity() -> None:
    with pytest.raises(ValueError, match="capacity"):
        Deduplicator(capacity=0)
