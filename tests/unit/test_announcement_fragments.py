"""Optional keys of control messages (``fragments``, ``trace``, a command's ``round``)."""

from __future__ import annotations

import json

import pytest

from geofed.control import Command, MessageError, RoundAnnouncement
from geofed.control.messages import decode, encode
from tests.support.control_messages import announcement


def test_a_streaming_announcement_carries_its_fragments_both_ways() -> None:
    sent = announcement(overlap="streaming", fragments=4)
    wire = json.loads(encode(sent))
    assert (wire["overlap"], wire["fragments"]) == ("streaming", 4)
    assert decode(encode(sent), RoundAnnouncement) == sent


def test_other_announcements_leave_the_key_out_so_older_agents_read_them() -> None:
    for overlap in ("none", "delayed"):
        sent = announcement(overlap=overlap)
        wire = json.loads(encode(sent))
        assert "fragments" not in wire
        assert decode(encode(sent), RoundAnnouncement).fragments is None


@pytest.mark.parametrize(
    ("overlap", "fragments"), [("streaming", None), ("delayed", 4), ("none", 2)]
)
def test_fragments_without_streaming_or_streaming_without_them_is_refused(
    overlap: str, fragments: int | None
) -> None:
    data = json.loads(encode(announcement()))
    data.update(overlap=overlap, fragments=fragments)
    with pytest.raises(MessageError, match="fragments"):
        decode(json.dumps(data).encode(), RoundAnnouncement)


def test_a_checkpoint_command_names_its_round_which_other_commands_leave_out() -> None:
    """The ask for a regional checkpoint (a region's hardware risk) is a command of its
    own, with its round; every other command is sent as before, without the key."""
    ask = Command(action="checkpoint", job="llm", round=4, reason="hardware risk")
    assert json.loads(encode(ask))["round"] == 4
    assert decode(encode(ask), Command) == ask
    assert "round" not in json.loads(encode(Command(action="pause", job="llm")))
    with pytest.raises(ValueError, match="names its round"):
        Command(action="checkpoint", job="llm")
    with pytest.raises(ValueError, match="names its round"):
        Command(action="pause", job="llm", round=3)


def test_an_unreadable_traceparent_is_none_and_the_round_stays() -> None:
    good = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    assert announcement(trace=good).trace == good
    data = json.loads(encode(announcement()))
    data["trace"] = "not a traceparent"
    assert decode(json.dumps(data).encode(), RoundAnnouncement).trace is None
