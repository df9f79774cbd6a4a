"""Control-plane topics: building, parsing, and refusing what would change their shape."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from geofed.control import ParsedTopic, TopicError, TopicKind, Topics
from geofed.types import InvalidName

T = Topics("acme")
names = st.from_regex(r"[a-z0-9](?:[a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)


def test_builds_the_documented_topics() -> None:
    assert T.region_status("eu-west") == "geofed/acme/regions/eu-west/status"
    assert T.region_commands("eu-west") == "geofed/acme/regions/eu-west/commands"
    assert T.job_round("llm-7") == "geofed/acme/jobs/llm-7/round"
    assert T.events() == "geofed/acme/events"
    assert T.all_region_status() == "geofed/acme/regions/+/status"
    assert T.all_region_commands() == "geofed/acme/regions/+/commands"
    assert T.all_job_rounds() == "geofed/acme/jobs/+/round"
    assert T.everything() == "geofed/acme/#"


@given(region=names, job=names)
def test_parse_inverts_build(region: str, job: str) -> None:
    assert T.parse(T.region_status(region)) == ParsedTopic(TopicKind.REGION_STATUS, region)
    assert T.parse(T.region_commands(region)) == ParsedTopic(TopicKind.REGION_COMMANDS, region)
    assert T.parse(T.job_round(job)) == ParsedTopic(TopicKind.JOB_ROUND, job)
    assert T.parse(T.events()) == ParsedTopic(TopicKind.EVENTS)


def test_parsed_topic_exposes_region_or_job_only_for_its_kind() -> None:
    status = T.parse(T.region_status("eu-west"))
    assert status.region == "eu-west"
    with pytest.raises(TopicError, match="names no job"):
        _ = status.job
    announcement = T.parse(T.job_round("j1"))
    assert announcement.job == "j1"
    with pytest.raises(TopicError, match="names no region"):
        _ = announcement.region
    with pytest.raises(TopicError, match="names no region"):
        _ = T.parse(T.events()).region


@pytest.mark.parametrize(
    "bad", ["+", "#", "eu/west", "eu+", "a#", "", "EU", "-eu", "eu-", "ü", "a" * 64, "eu west"]
)
def test_builder_refuses_names_that_would_change_the_topic(bad: str) -> None:
    with pytest.raises(InvalidName):
        T.region_status(bad)
    with pytest.raises(InvalidName):
        T.region_commands(bad)
    with pytest.raises(InvalidName):
        T.job_round(bad)
    with pytest.raises(InvalidName):
        Topics(bad)


@pytest.mark.parametrize(
    ("topic", "reason"),
    [
        ("geofed/other/events", "belongs to federation 'other'"),
        ("geofed/acme/regions/+/status", "invalid region"),
        ("geofed/acme/regions/#", "unknown geofed topic layout"),
        ("geofed/acme/jobs/a/b/round", "unknown geofed topic layout"),
        ("geofed/acme/jobs/UP/round", "invalid job"),
        ("geofed/acme/regions/eu/status/extra", "unknown geofed topic layout"),
        ("geofed/acme/regions/eu/round", "unknown geofed topic layout"),
        ("geofed/acme/events/", "unknown geofed topic layout"),
        ("geofed/acme", "not a geofed topic"),
        ("other/acme/events", "not a geofed topic"),
        ("/geofed/acme/events", "not a geofed topic"),
        ("", "not a geofed topic"),
        ("geofed/acme/regions//status", "invalid region"),
    ],
)
def test_parse_refuses_with_a_reason(topic: str, reason: str) -> None:
    with pytest.raises(TopicError, match=reason.replace("+", r"\+")):
        T.parse(topic)


def test_parse_refuses_oversized_and_non_string_topics() -> None:
    with pytest.raises(TopicError, match="longer than"):
        T.parse("geofed/acme/" + "x" * 70000)
    with pytest.raises(TopicError, match="must be a string"):
        T.parse(b"geofed/acme/events")  # type: ignore[arg-type]


@given(st.text(max_size=80))
def test_parse_of_any_text_returns_or_raises_topic_error(topic: str) -> None:
    try:
        parsed = T.parse(topic)
    except TopicError:
        return
    # Anything accepted must rebuild to exactly the same topic.
    rebuilt = {
        TopicKind.EVENTS: lambda p: T.events(),
        TopicKind.REGION_STATUS: lambda p: T.region_status(p.region),
        TopicKind.REGION_COMMANDS: lambda p: T.region_commands(p.region),
        TopicKind.JOB_ROUND: lambda p: T.job_round(p.job),
    }[parsed.kind](parsed)
    assert rebuilt == topic


def test_topic_error_is_a_value_error_for_callers_that_expect_one() -> None:
    assert issubclass(TopicError, ValueError)
