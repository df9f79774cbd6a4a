"""The round announcement's ``fragments``: present for streaming jobs only, on the wire too."""

from __future__ import annotations

import json

import pytest

from geofed.control import MessageError, RoundAnnouncement
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
