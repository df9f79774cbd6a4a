"""Back-off (exponential growth, a cap, injected jitter) and a retry loop's failure count."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from geofed.backoff import Backoff, Retry


class FixedRandom(random.Random):
    """A fake random source returning one value, so delays are exact."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


def test_ceiling_doubles_up_to_the_cap() -> None:
    policy = Backoff(initial_s=0.5, max_s=4.0, multiplier=2.0)
    assert [policy.ceiling(n) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_huge_attempt_numbers_stay_at_the_cap() -> None:
    assert Backoff(max_s=30.0).ceiling(10_000) == 30.0
    assert Backoff(initial_s=1.0, max_s=1.0, multiplier=1.0).ceiling(10_000) == 1.0


def test_jitter_scales_the_delay_down_by_the_drawn_fraction() -> None:
    policy = Backoff(initial_s=1.0, max_s=8.0, jitter=0.5)
    assert policy.delay(2, FixedRandom(0.0)) == 4.0
    assert policy.delay(2, FixedRandom(1.0)) == 2.0
    assert Backoff(initial_s=1.0, jitter=0.0).delay(0, FixedRandom(0.9)) == 1.0
    assert Backoff(initial_s=1.0, jitter=1.0).delay(0, FixedRandom(0.75)) == pytest.approx(0.25)


@given(attempt=st.integers(min_value=0, max_value=200), seed=st.integers())
def test_delay_always_within_jitter_band(attempt: int, seed: int) -> None:
    policy = Backoff(initial_s=0.1, max_s=10.0, jitter=0.3)
    delay = policy.delay(attempt, random.Random(seed))
    ceiling = policy.ceiling(attempt)
    assert 0.7 * ceiling - 1e-12 <= delay <= ceiling


def test_same_seed_same_schedule() -> None:
    policy = Backoff()
    first = [policy.delay(n, random.Random(7)) for n in range(5)]
    assert first == [policy.delay(n, random.Random(7)) for n in range(5)]


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"initial_s": 0}, "initial_s must be > 0"),
        ({"initial_s": 2.0, "max_s": 1.0}, "below initial_s"),
        ({"multiplier": 0.5}, "multiplier must be >= 1"),
        ({"jitter": 1.5}, r"jitter must be in \[0, 1\]"),
        ({"reset_after_s": -1}, "reset_after_s must be >= 0"),
        ({"max_s": float("inf")}, "finite"),
    ],
)
def test_bad_policies_are_refused(kwargs: dict[str, float], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        Backoff(**kwargs)


def test_negative_attempt_is_refused() -> None:
    with pytest.raises(ValueError, match="attempt"):
        Backoff().delay(-1, random.Random(0))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class RecordingSleep:
    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.calls.append(delay)


async def test_each_failure_waits_the_next_delay_of_the_schedule() -> None:
    sleep = RecordingSleep()
    retry = Retry(Backoff(initial_s=1.0, max_s=4.0, jitter=0.5), rng=FixedRandom(1.0), sleep=sleep)
    assert retry.failures == 0
    for _ in range(4):
        await retry.wait(retry.failed())
    assert sleep.calls == [0.5, 1.0, 2.0, 2.0]
    assert retry.failures == 4
    retry.reset()
    assert (retry.failures, retry.failed()) == (0, 0.5)


def test_a_healthy_spell_resets_the_count() -> None:
    clock = FakeClock()
    retry = Retry(Backoff(initial_s=1.0, jitter=0.0, reset_after_s=10.0), clock=clock)
    since = retry.now()
    retry.failed()
    retry.failed()
    clock.now += 9.5
    assert not retry.recovered(since)
    assert retry.failures == 2
    clock.now += 0.5
    assert retry.recovered(since)
    assert retry.failures == 0
    retry.failed()
    assert not retry.recovered(since, healthy_after_s=60.0)
    assert retry.recovered(since, healthy_after_s=10.0)


def test_without_a_random_source_the_delay_stays_in_its_band() -> None:
    retry = Retry(Backoff(initial_s=2.0, jitter=0.25))
    assert 1.5 <= retry.failed() <= 2.0
