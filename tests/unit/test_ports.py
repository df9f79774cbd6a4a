"""Where a port for a later bind is picked: outside the kernel's ephemeral range."""

from __future__ import annotations

import pytest

from geofed.ports import DEFAULT_EPHEMERAL, LOWEST, candidate_range, ephemeral_range


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("32768\t60999\n", (32768, 60999)),
        ("1024 65535", (1024, 65535)),
        (None, DEFAULT_EPHEMERAL),
        ("", DEFAULT_EPHEMERAL),
        ("32768", DEFAULT_EPHEMERAL),
        ("60999 32768", DEFAULT_EPHEMERAL),
        ("0 70000", DEFAULT_EPHEMERAL),
    ],
)
def test_the_ephemeral_range_is_read_or_defaulted(
    text: str | None, expected: tuple[int, int]
) -> None:
    assert ephemeral_range(text) == expected


def test_ports_are_picked_below_the_ephemeral_range_when_there_is_room() -> None:
    assert candidate_range((32768, 60999)) == (LOWEST, 32768)


def test_ports_are_picked_above_a_range_that_starts_low() -> None:
    assert candidate_range((10500, 49151)) == (49152, 65536)


def test_a_range_covering_every_port_leaves_nothing_to_pick() -> None:
    assert candidate_range((1024, 65535)) is None
