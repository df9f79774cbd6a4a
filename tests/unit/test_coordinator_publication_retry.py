"""The back-off of failed publications: its schedule, its configuration, its record."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config import ConfigError, PublicationRetryConfig, load_config, parse_config
from coordinator.rounds.quarantine import Quarantine, QuarantineConfig
from coordinator.rounds.records import RoundRecord
from coordinator.rounds.state import RoundConfig, RoundState
from tests.support.configs import MINIMAL_COORDINATOR as MINIMAL

REPO = Path(__file__).resolve().parents[2]


def test_the_wait_doubles_from_initial_s_and_stops_at_max_s() -> None:
    retry = PublicationRetryConfig(initial_s=5, max_s=300, max_attempts=10)
    schedule = [retry.delay_s(n) for n in range(1, 11)]
    assert schedule == [5, 10, 20, 40, 80, 160, 300, 300, 300, 300]


def test_the_wait_is_capped_however_many_failures() -> None:
    retry = PublicationRetryConfig(initial_s=0.25, max_s=2, max_attempts=10_000)
    assert [retry.delay_s(n) for n in (1, 2, 3, 4, 5)] == [0.25, 0.5, 1, 2, 2]
    assert retry.delay_s(10_000) == 2
    assert retry.delay_s(10**9) == 2  # no float overflow


def test_the_shortest_wait_still_reaches_the_longest() -> None:
    retry = PublicationRetryConfig(initial_s=0.001, max_s=86400, max_attempts=100)
    assert retry.delay_s(27) < 86400
    assert retry.delay_s(28) == retry.delay_s(100) == 86400


def test_equal_bounds_give_a_constant_wait() -> None:
    retry = PublicationRetryConfig(initial_s=3, max_s=3, max_attempts=4)
    assert [retry.delay_s(n) for n in (1, 2, 3)] == [3, 3, 3]


@pytest.mark.parametrize("failures", [0, -1])
def test_failures_count_from_one(failures: int) -> None:
    with pytest.raises(ValueError, match="counts from 1"):
        PublicationRetryConfig().delay_s(failures)


def test_defaults_ride_out_about_twenty_minutes() -> None:
    retry = parse_config(MINIMAL, "c.yaml", base=Path("/etc/geofed")).publication_retry
    assert (retry.initial_s, retry.max_s, retry.max_attempts) == (5, 300, 10)
    # Waits happen between attempts: one fewer than the attempts.
    assert sum(retry.delay_s(n) for n in range(1, retry.max_attempts)) == 1215


def test_the_example_configuration_sets_it() -> None:
    retry = load_config(REPO / "configs" / "coordinator.yaml").publication_retry
    assert (retry.initial_s, retry.max_s, retry.max_attempts) == (5, 300, 10)


def test_a_configured_retry_is_read() -> None:
    text = MINIMAL + "publication_retry: {initial_s: 0.5, max_s: 8, max_attempts: 3}\n"
    retry = parse_config(text, "c.yaml", base=Path("/etc/geofed")).publication_retry
    assert [retry.delay_s(n) for n in (1, 2, 3, 4, 5, 6)] == [0.5, 1, 2, 4, 8, 8]
    assert retry.max_attempts == 3


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        (
            "{initial_s: 60, max_s: 30}",
            "c.yaml:9: publication_retry: max_s (30) must be at least initial_s (60)",
        ),
        (
            "{initial_s: 0}",
            "c.yaml:9: publication_retry.initial_s: Input should be greater than or equal to 0.001",
        ),
        ("{max_s: -1}", "c.yaml:9: publication_retry.max_s: Input should be greater than 0"),
        ("{max_s: .inf}", "c.yaml:9: publication_retry.max_s: Input should be a finite number"),
        (
            "{max_attempts: 0}",
            "c.yaml:9: publication_retry.max_attempts: Input should be greater than or equal to 1",
        ),
        (
            "{max_attempts: 2.5}",
            "c.yaml:9: publication_retry.max_attempts: Input should be a valid integer",
        ),
        ("{initial: 5}", "c.yaml:9: publication_retry.initial: unknown key; allowed keys:"),
    ],
)
def test_errors_name_the_key(section: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(MINIMAL + f"publication_retry: {section}\n", "c.yaml", base=Path("/"))
    assert caught.value.problems[0].startswith(expected), caught.value.problems


def _record(publication_failures: int) -> RoundRecord:
    config = RoundConfig(
        round=3, participants=("eu-west", "us-east"), min_regions=1, opened_at=100.0, deadline_s=60
    )
    return RoundRecord(
        state=RoundState.open(config),
        attempt=1,
        failures=0,
        deadline_reason="initial",
        quarantine=Quarantine(QuarantineConfig()),
        publication_failures=publication_failures,
    )


def test_the_round_record_keeps_its_publication_failures() -> None:
    data = _record(4).to_dict()
    assert data["publication_failures"] == 4
    assert RoundRecord.from_dict(data, QuarantineConfig()).publication_failures == 4


def test_a_record_written_before_the_count_existed_has_none() -> None:
    data = _record(0).to_dict()
    del data["publication_failures"]
    assert RoundRecord.from_dict(data, QuarantineConfig()).publication_failures == 0


def test_a_damaged_count_is_refused() -> None:
    data = {**_record(0).to_dict(), "publication_failures": "many"}
    with pytest.raises(ValueError, match="publication_failures"):
        RoundRecord.from_dict(data, QuarantineConfig())
