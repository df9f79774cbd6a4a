"""Late deltas merged into a later round: the verdicts, the weight, the grace window."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from pydantic import ValidationError

from coordinator.aggregation.config import AggregationConfig
from coordinator.aggregation.outer_round import delta_sources
from coordinator.errors import Conflict, Unavailable
from coordinator.rounds.acceptance import refusal
from coordinator.rounds.deadline import RoundTiming
from coordinator.rounds.late import (
    MIN_GRACE_S,
    grace_window,
    late_key,
    staleness_factor,
    still_behind,
    validate_key,
)
from coordinator.rounds.past_rounds import PastRounds
from coordinator.rounds.quarantine import Outcome, round_outcomes
from coordinator.rounds.state import (
    Action,
    DeltaVerdictCode,
    JobIntake,
    RoundConfig,
    RoundState,
    RoundStateError,
    judge_delta,
)
from coordinator.state.store import Receipt
from geofed.control import RoundAnnouncement, decode
from geofed.control.messages import RegionStatus
from geofed.types import InvalidName
from tests.support.agent_schedule import announce

T0 = 1_700_000_000.0
REGIONS = ("eu-west", "us-east")


def opened(
    round_: int, *, grace_s: float | None = None, base_hash: str | None = "ab" * 32
) -> RoundState:
    config = RoundConfig(
        round=round_,
        participants=REGIONS,
        min_regions=1,
        opened_at=T0 + 100 * round_,
        deadline_s=60.0,
        base_hash=base_hash,
        grace_s=grace_s,
    )
    return RoundState.open(config)


def published_without_us(round_: int, base_hash: str | None = "ab" * 32) -> RoundState:
    """Round ``round_`` closed and published with eu-west only: us-east was a straggler."""
    state = opened(round_, base_hash=base_hash)
    start = state.config.opened_at
    state.on_delta("eu-west", round_, start + 10)
    state.tick(start + 61)
    state.mark_published(start + 62)
    return state


def intake(version: int, *past: RoundState, reach: int = 2) -> JobIntake:
    return JobIntake("llm", version, "", reach, {p.config.round: p for p in past})


def test_staleness_discounts_tokens_and_names_the_late_delta() -> None:
    assert [staleness_factor(s) for s in (0, 1, 2, 3)] == [1.0, 0.5, 1 / 3, 0.25]
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        staleness_factor(-1)
    assert late_key("us-east", 4) == "us-east@4"
    assert validate_key("us-east@4") == "us-east@4"
    for bad in ("us-east@", "us-east@x", "US@1", "@3", "us-east@1@2"):
        with pytest.raises(InvalidName):
            validate_key(bad)
    receipts = [Receipt("llm", 5, "eu-west", "aa" * 32, "a1" * 32, 10, 300, T0)]
    late = [Receipt("llm", 3, "us-east", "bb" * 32, "b1" * 32, 10, 300, T0)]
    sources = delta_sources(receipts, ["eu-west"], late, 5)
    assert [(s.key, s.staleness, s.weight) for s in sources] == [
        ("eu-west", 0, 300.0),
        ("us-east@3", 2, 100.0),
    ]
    with pytest.raises(ValueError, match="a delta of round 5 is not late for round 5"):
        delta_sources([], [], receipts, 5)


def test_a_late_delta_is_merged_into_the_round_collecting_now() -> None:
    current = opened(3)
    verdict = judge_delta(current, "us-east", 2, T0 + 310, intake(3, published_without_us(2)))
    assert verdict.code is DeltaVerdictCode.MERGED
    assert verdict.accepted
    assert "merged into round 3, 1 round(s) late (weight x 0.5)" in verdict.reason
    current.merge("us-east", 2, T0 + 310)
    assert [(a.region, a.round) for a in current.merged] == [("us-east", 2)]
    assert current.delivered == ()  # a late delta is not one of this round's deliveries
    again = judge_delta(current, "us-east", 2, T0 + 311, intake(3, published_without_us(2)))
    assert again.code is DeltaVerdictCode.DUPLICATE
    assert "already merged into round 3" in again.reason
    with pytest.raises(RoundStateError, match="merged already"):
        current.merge("us-east", 2, T0 + 312)
    # Its own round's delta is another delta: still welcome.
    own = current.on_delta("us-east", 3, T0 + 313)
    assert own.code is DeltaVerdictCode.ACCEPTED


@pytest.mark.parametrize(
    ("version", "past", "current", "code", "why"),
    [
        (4, (), "collecting", DeltaVerdictCode.LATE, "2 rounds behind round 4"),
        (3, (), "collecting", DeltaVerdictCode.LATE, "no published record at hand"),
        (3, ("included",), "collecting", DeltaVerdictCode.DUPLICATE, "taken in its own round"),
        (3, ("no-hash",), "collecting", DeltaVerdictCode.LATE, "without θ's hash"),
        (3, ("straggler",), "closed", DeltaVerdictCode.NOT_YET, "send it again then"),
        (3, ("straggler",), "none", DeltaVerdictCode.NOT_YET, "round 3 of job llm is not"),
    ],
    ids=["too-stale", "no-record", "was-on-time", "no-hash", "closed", "not-opened"],
)
def test_what_a_late_delta_gets(
    version: int, past: tuple[str, ...], current: str, code: DeltaVerdictCode, why: str
) -> None:
    kept = []
    if "straggler" in past:
        kept.append(published_without_us(2))
    if "no-hash" in past:
        kept.append(published_without_us(2, base_hash=None))
    if "included" in past:
        state = opened(2)
        state.on_delta("us-east", 2, T0 + 210)
        state.tick(T0 + 261)
        state.mark_published(T0 + 262)
        kept.append(state)
    rs: RoundState | None = None
    if current != "none":
        rs = opened(version)
        if current == "closed":
            rs.on_delta("eu-west", version, T0 + 310)
            rs.tick(T0 + 400)
    verdict = judge_delta(rs, "us-east", 2, T0 + 401, intake(version, *kept, reach=1))
    assert verdict.code is code, verdict.reason
    assert why in verdict.reason


def test_a_job_that_drops_late_deltas_refuses_them_as_before() -> None:
    verdict = judge_delta(
        opened(3), "us-east", 2, T0 + 310, intake(3, published_without_us(2), reach=0)
    )
    assert verdict.code is DeltaVerdictCode.LATE
    assert "round 2 of job llm is over" in verdict.reason
    assert isinstance(refusal(verdict), Conflict)


def test_a_straggler_of_the_round_closing_now_is_asked_to_send_again() -> None:
    current = opened(3)
    current.on_delta("eu-west", 3, T0 + 310)
    assert current.tick(T0 + 361).action is Action.CLOSE
    verdict = judge_delta(current, "us-east", 3, T0 + 362, intake(3))
    assert verdict.code is DeltaVerdictCode.NOT_YET
    assert "merges into round 4" in verdict.reason
    answer = refusal(verdict)
    assert isinstance(answer, Unavailable)
    assert answer.status == 503
    dropping = judge_delta(current, "us-east", 3, T0 + 362, intake(3, reach=0))
    assert dropping.code is DeltaVerdictCode.LATE


def test_the_grace_window_closes_a_round_after_its_quorum() -> None:
    current = opened(3, grace_s=5.0)
    start = current.config.opened_at
    wait = current.tick(start + 1)
    assert (wait.action, wait.wake_at) == (Action.WAIT, start + 60)
    current.merge("us-east", 2, start + 2)  # a late delta counts for no quorum
    assert current.tick(start + 3).wake_at == start + 60
    current.on_delta("eu-west", 3, start + 10)
    wait = current.tick(start + 12)
    assert (wait.action, wait.wake_at) == (Action.WAIT, start + 15)
    assert "until the quorum's grace window ends" in wait.reason
    closed = current.tick(start + 15)
    assert closed.action is Action.CLOSE
    assert "grace window of 5 s ended" in closed.reason
    assert "their deltas merge into round 4" in closed.reason
    assert closed.included == ("eu-west",)
    assert current.summed == ("us-east@2", "eu-west")
    # Timing for the adaptive deadline counts this round's own arrivals only.
    timing = current.timing()
    assert timing is not None
    assert timing.arrivals_s == (10.0,)


def test_a_merged_round_survives_its_saved_form() -> None:
    current = opened(3)
    current.merge("us-east", 1, T0 + 305)
    current.on_delta("eu-west", 3, T0 + 306)
    again = RoundState.from_dict(current.to_dict())
    assert again.merged == current.merged
    assert again.arrivals == current.arrivals
    data = current.to_dict()
    data["arrivals"][0]["round"] = 3  # not earlier than the round itself
    with pytest.raises(RoundStateError, match="not of an earlier round"):
        RoundState.from_dict(data)
    with pytest.raises(RoundStateError, match="cannot merge a delta of round 3"):
        current.merge("us-east", 3, T0 + 307)


def test_the_grace_window_is_sized_from_arrival_slack() -> None:
    assert grace_window([], 1, 7.5) == (7.5, "grace window 7.5 s, set by the job")
    value, why = grace_window([], 2, None)
    assert value is None
    assert "waits for its deadline" in why
    # Quorum 1: the later arrivals came 2, 4 and 6 s behind the first.
    history = [RoundTiming(60.0, (10.0, 12.0)), RoundTiming(60.0, (20.0, 24.0, 26.0))]
    value, why = grace_window(history, 1, None)
    assert value == pytest.approx(2 * 5.6)
    assert "3 arrivals' lag behind the quorum" in why
    # Too few later arrivals: half the median time the quorum took.
    value, why = grace_window([RoundTiming(60.0, (10.0,)), RoundTiming(60.0, (30.0,))], 1, None)
    assert value == 10.0
    assert "half the median 20.0 s" in why
    assert grace_window([RoundTiming(60.0, (0.5,))], 1, None)[0] == MIN_GRACE_S


def test_past_rounds_keep_what_a_late_delta_may_reach() -> None:
    past = PastRounds(2)
    for number in (1, 2, 3):
        past.remember(published_without_us(number))
    assert past.base_hash(1) is None  # round 4 is current: round 1 is 3 behind
    assert past.base_hash(2) == "ab" * 32
    assert set(past.intake("llm", 4, "").past) == {2, 3}
    none = PastRounds(0)
    none.remember(published_without_us(1))
    assert none.intake("llm", 2, "").past == {}


def test_merging_needs_weights_and_whole_rounds() -> None:
    AggregationConfig(late="merge")
    with pytest.raises(ValidationError, match="late merge needs rule mean: median"):
        AggregationConfig(late="merge", rule="median")
    with pytest.raises(ValidationError, match="less than or equal to 16"):
        AggregationConfig(late="merge", max_staleness=17)


def test_the_announcement_carries_the_reach_only_when_merging() -> None:
    assert "max_staleness" not in announce().model_dump_json()
    sent = announce(max_staleness=2)
    assert decode(sent.model_dump_json().encode(), RoundAnnouncement).max_staleness == 2


def test_a_straggler_whose_late_work_was_merged_counts_as_delivered() -> None:
    outcomes = round_outcomes(["eu-west"], ["us-east", "ap-south"], merged=["us-east"])
    assert outcomes == {
        "eu-west": Outcome.DELIVERED,
        "us-east": Outcome.DELIVERED,
        "ap-south": Outcome.STRAGGLER,
    }
    assert round_outcomes(["eu-west"], ["us-east"])["us-east"] is Outcome.STRAGGLER


@dataclass
class _View:
    status: RegionStatus


def _status(region: str, state: str, round_: int | None, job: str = "llm") -> _View:
    status = RegionStatus(region=region, state=state, job=job, round=round_, agent_version="1")  # type: ignore[arg-type]
    return _View(status)


def test_a_round_does_not_wait_for_a_region_still_at_an_earlier_one() -> None:
    views = {
        "us-east": _status("us-east", "training", 2),
        "ap-south": _status("ap-south", "uploading", 3),
        "sa-east": _status("sa-east", "online", 1),
        "eu-north": _status("eu-north", "training", 1, job="other"),
    }
    assert still_behind(views, "llm", 3) == {"us-east"}
    # A status naming a round whose delta arrived is only older than the region's next.
    assert still_behind(views, "llm", 3, {("us-east", 2)}) == set()
    past = PastRounds(2)
    past.remember(published_without_us(2))
    merging = opened(3)
    merging.merge("us-east", 2, T0 + 305)
    assert past.received(merging) == {("eu-west", 2), ("us-east", 2)}
    current = opened(3)
    current.on_delta("eu-west", 3, T0 + 310)
    closed = current.tick(T0 + 311, behind={"us-east"})
    assert closed.action is Action.CLOSE
    assert "us-east still at an earlier round" in closed.reason
    assert "merges into round 4" in closed.reason
    # Below quorum, or with someone else missing, it waits as before.
    waiting = opened(3)
    assert waiting.tick(T0 + 301, behind={"us-east"}).action is Action.WAIT
    waiting.on_delta("eu-west", 3, T0 + 310)
    assert waiting.tick(T0 + 311).action is Action.WAIT
