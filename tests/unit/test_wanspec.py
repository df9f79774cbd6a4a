"""Reading a WAN link as people write it (``geofed demo --wan 5mbit,100ms``)."""

from __future__ import annotations

import pytest

from geofed.wanemu import LinkSettings
from geofed.wanspec import WanLink, WanSpecError, parse_bandwidth, parse_duration, parse_link
from geofed_cli import main


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("5mbit", 5e6),
        ("1Gbit", 1e9),
        ("800kbit/s", 8e5),
        ("2.5mbps", 2.5e6),
        ("100 bit", 100.0),
        ("1e3kbit", 1e6),
    ],
)
def test_bandwidth_units(text: str, bits: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(bits)


@pytest.mark.parametrize(("text", "seconds"), [("100ms", 0.1), ("0.08s", 0.08), ("0ms", 0.0)])
def test_duration_units(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


def test_a_link_becomes_each_direction_of_the_emulator() -> None:
    link = parse_link("5mbit,100ms")
    assert link == WanLink(5e6, 0.1)
    assert link.settings() == LinkSettings(latency_s=0.05, bandwidth_bps=625_000)
    assert link.describe() == "5 Mbit/s, 100 ms RTT"
    assert link.scaled(1000) == WanLink(5e3, 0.1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("5mbit", "expected BANDWIDTH,RTT"),
        ("5mbit,100ms,1", "expected BANDWIDTH,RTT"),
        ("5,100ms", "expected a number and a unit"),
        ("5mb,100ms", "unknown unit 'mb'"),
        ("0mbit,100ms", "more than 0"),
        ("5mbit,100", "round-trip time '100'"),
        ("5mbit,1min", "unknown unit 'min'"),
        ("5mbit,-1ms", "expected a number and a unit"),
        ("fast,100ms", "bandwidth 'fast'"),
    ],
)
def test_bad_links_say_what_is_expected(text: str, message: str) -> None:
    with pytest.raises(WanSpecError, match=message):
        parse_link(text)


def test_the_demo_refuses_a_bad_wan_as_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--wan", "5mb,100ms"])
    assert exc.value.code == 2
    assert "unknown unit 'mb'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--task-options", "[1]"])
    assert exc.value.code == 2
    assert "expected a JSON object" in capsys.readouterr().err
