"""Round state machine: deadline, quorum, late/duplicate deltas, restart."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from coordinator.rounds.deadline import RoundTiming
from coordinator.rounds.state import (
    Action,
    DeltaVerdictCode,
    RoundConfig,
    RoundPhase,
    RoundState,
    RoundStateError,
)

T0 = 1_700_000_000.0
REGIONS = ("ap-south", "eu-west", "us-east")


def make_round(**overrides) -> RoundState:
    fields: dict[str, object] = {
        "round": 5,
        "participants": ("us-east", "eu-west", "ap-south"),
        "min_regions": 2,
        "opened_at": T0,
        "deadline_s": 600.0,
    }
    fields.update(overrides)
    return RoundState.open(RoundConfig.model_validate(fields))


def test_closes_as_soon_as_everyone_delivered() -> None:
    state = make_round()
    for i, region in enumerate(["us-east", "ap-south", "eu-west"]):
        verdict = state.on_delta(region, 5, T0 + 100 + i)
        assert verdict.code is DeltaVerdictCode.ACCEPTED
        assert verdict.accepted
    assert "3 of 3 delivered, quorum 2" in verdict.reason
    decision = state.tick(T0 + 103)
    assert decision.action is Action.CLOSE
    assert decision.reason == "all 3 participants delivered"
    assert decision.included == REGIONS
    assert decision.stragglers == ()
    assert state.phase is RoundPhase.AGGREGATING
    assert state.delivered == ("us-east", "ap-south", "eu-west")  # acceptance order kept


def test_waits_for_everyone_until_the_deadline_even_at_quorum() -> None:
    state = make_round()
    state.on_delta("eu-west", 5, T0 + 10)
    state.on_delta("us-east", 5, T0 + 20)
    decision = state.tick(T0 + 30)
    assert decision.action is Action.WAIT
    assert decision.wake_at == T0 + 600
    assert decision.reason == (
        "waiting for 1 of 3 participants (ap-south) until the deadline at +600.000 s; "
        "2 delivered, quorum 2"
    )
    assert state.phase is RoundPhase.COLLECTING


def test_deadline_at_quorum_closes_with_stragglers() -> None:
    state = make_round()
    state.on_delta("eu-west", 5, T0 + 10)
    state.on_delta("us-east", 5, T0 + 20)
    decision = state.tick(T0 + 600)
    assert decision.action is Action.CLOSE
    assert decision.included == ("eu-west", "us-east")
    assert decision.stragglers == ("ap-south",)
    assert decision.reason == (
        "deadline passed with 2 of 3 participants delivered (quorum 2); stragglers: ap-south"
    )
    assert state.stragglers == ("ap-south",)
    assert state.tick(T0 + 700).action is Action.IDLE


def test_below_quorum_extends_then_fails() -> None:
    state = make_round(max_extensions=1, extension_s=120.0)
    state.on_delta("eu-west", 5, T0 + 10)
    extend = state.tick(T0 + 605)
    assert extend.action is Action.EXTEND
    assert extend.wake_at == T0 + 725
    assert extend.stragglers == ("ap-south", "us-east")
    assert extend.reason == (
        "deadline passed with 1 of 3 delivered, below quorum 2; extension 1 of 1 by 120 s, "
        "new deadline at +725.000 s"
    )
    assert state.tick(T0 + 700).action is Action.WAIT
    fail = state.tick(T0 + 725)
    assert fail.action is Action.FAIL
    assert fail.reason == (
        "deadline passed with 1 of 3 delivered, below quorum 2 after 1 extension(s); round 5 failed"
    )
    assert state.phase is RoundPhase.FAILED
    assert state.end_reason == fail.reason


def test_extension_gives_a_slow_region_its_chance() -> None:
    state = make_round()  # extension defaults to half the deadline
    state.on_delta("eu-west", 5, T0 + 10)
    assert state.tick(T0 + 600).action is Action.EXTEND
    assert state.deadline_at == T0 + 900
    assert state.on_delta("us-east", 5, T0 + 800).code is DeltaVerdictCode.ACCEPTED
    decision = state.tick(T0 + 900)
    assert decision.action is Action.CLOSE
    assert decision.included == ("eu-west", "us-east")


def test_no_extensions_fails_at_the_deadline() -> None:
    state = make_round(max_extensions=0)
    assert state.tick(T0 + 600).action is Action.FAIL


def test_duplicates_are_idempotent_before_and_after_closing() -> None:
    state = make_round()
    state.on_delta("eu-west", 5, T0 + 10)
    again = state.on_delta("eu-west", 5, T0 + 11)
    assert again.code is DeltaVerdictCode.DUPLICATE
    assert again.accepted  # the upload layer answers 200 again
    assert "already accepted at +10.000 s; it is counted once" in again.reason
    assert state.delivered == ("eu-west",)
    state.on_delta("us-east", 5, T0 + 12)
    state.tick(T0 + 600)
    state.mark_published(T0 + 650)
    after = state.on_delta("us-east", 5, T0 + 700)
    assert after.code is DeltaVerdictCode.DUPLICATE
    assert after.accepted


def test_straggler_delivering_after_close_is_late() -> None:
    state = make_round()
    state.on_delta("eu-west", 5, T0 + 10)
    state.on_delta("us-east", 5, T0 + 20)
    state.tick(T0 + 600)
    late = state.on_delta("ap-south", 5, T0 + 601)
    assert late.code is DeltaVerdictCode.LATE
    assert not late.accepted
    assert late.reason == (
        "round 5 closed at +600.000 s without ap-south, counted as a straggler; its delta "
        "is not used, the region should join round 6"
    )
    assert state.delivered == ("eu-west", "us-east")


def test_delta_after_a_failed_round_is_late() -> None:
    state = make_round(max_extensions=0)
    state.tick(T0 + 600)
    late = state.on_delta("eu-west", 5, T0 + 601)
    assert late.code is DeltaVerdictCode.LATE
    assert late.reason.startswith("round 5 is failed (deadline passed with 0 of 3")


def test_delta_after_the_deadline_but_before_the_closing_tick_counts() -> None:
    state = make_round()
    state.on_delta("eu-west", 5, T0 + 10)
    state.on_delta("us-east", 5, T0 + 20)
    assert state.on_delta("ap-south", 5, T0 + 600.5).code is DeltaVerdictCode.ACCEPTED
    assert state.tick(T0 + 601).reason == "all 3 participants delivered"


@pytest.mark.parametrize(
    ("region", "round_", "code", "reason"),
    [
        (
            "sa-east",
            5,
            DeltaVerdictCode.NOT_PARTICIPANT,
            "'sa-east' is not a participant of round 5 (participants: ap-south, eu-west, us-east)",
        ),
        ("NOT A NAME", 5, DeltaVerdictCode.NOT_PARTICIPANT, "'NOT A NAME' is not a participant"),
        ("eu-west", 4, DeltaVerdictCode.WRONG_ROUND, "delta is for round 4, this is round 5"),
        ("eu-west", 6, DeltaVerdictCode.WRONG_ROUND, "delta is for round 6, this is round 5"),
    ],
)
def test_refused_deltas(region, round_, code, reason) -> None:
    state = make_round()
    verdict = state.on_delta(region, round_, T0 + 1)
    assert verdict.code is code
    assert not verdict.accepted
    assert verdict.reason.startswith(reason)
    assert state.delivered == ()


def test_publish_fail_and_abandon_transitions() -> None:
    collecting = make_round()
    with pytest.raises(RoundStateError, match="only an aggregating round can be published"):
        collecting.mark_published(T0 + 1)
    collecting.abandon(T0 + 2, "job cancelled by operator")
    assert collecting.phase is RoundPhase.ABANDONED
    with pytest.raises(RoundStateError, match="already ended as abandoned"):
        collecting.fail(T0 + 3, "too late")

    closed = make_round()
    for region in REGIONS:
        closed.on_delta(region, 5, T0 + 1)
    closed.tick(T0 + 2)
    closed.fail(T0 + 3, "aggregation failed: eu-west's spooled delta is unreadable")
    assert closed.phase is RoundPhase.FAILED
    with pytest.raises(RoundStateError, match="a reason is required"):
        make_round().fail(T0, "")


@pytest.mark.parametrize("now", [float("nan"), float("inf"), "soon", True])
def test_bad_clock_is_refused(now) -> None:
    state = make_round()
    with pytest.raises(RoundStateError, match="now must be a finite number"):
        state.tick(now)
    with pytest.raises(RoundStateError, match="now must be a finite number"):
        state.on_delta("eu-west", 5, now)
    assert state.delivered == ()


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"min_regions": 4}, r"min_regions \(4\) exceeds the 3 participants"),
        ({"min_regions": 0}, "greater than or equal to 1"),
        ({"participants": ()}, "at least one participant"),
        ({"participants": ("eu-west", "eu-west")}, "listed more than once"),
        ({"participants": ("EU_West",)}, "invalid region 'EU_West'"),
        ({"deadline_s": 0.0}, "greater than 0"),
        ({"round": -1}, "greater than or equal to 0"),
    ],
)
def test_config_validation(overrides, needle) -> None:
    with pytest.raises(ValidationError, match=needle):
        make_round(**overrides)


def test_timing_for_the_adaptive_deadline() -> None:
    state = make_round()
    assert state.timing() is None
    state.on_delta("eu-west", 5, T0 + 100)
    state.on_delta("us-east", 5, T0 + 250)
    state.tick(T0 + 600)
    assert state.timing() == RoundTiming(deadline_s=600.0, arrivals_s=(100.0, 250.0), stragglers=1)


def reload(state: RoundState) -> RoundState:
    # Through JSON text with sorted keys, as the store writes it.
    return RoundState.from_dict(json.loads(json.dumps(state.to_dict(), sort_keys=True)))


events = st.lists(
    st.one_of(
        st.tuples(
            st.just("delta"),
            st.sampled_from([*REGIONS, "sa-east"]),
            st.sampled_from([4, 5, 5, 5, 6]),
            st.floats(0, 400),
        ),
        st.tuples(st.just("tick"), st.just(""), st.just(0), st.floats(0, 400)),
        st.tuples(st.just("publish"), st.just(""), st.just(0), st.floats(0, 10)),
    ),
    max_size=14,
)


def apply(state: RoundState, event, now: float):
    kind, region, round_, _ = event
    if kind == "delta":
        return state.on_delta(region, round_, now)
    if kind == "tick":
        return state.tick(now)
    if state.phase is RoundPhase.AGGREGATING:
        state.mark_published(now)
        return "published"
    return "skip"


@settings(max_examples=150, deadline=None)
@given(
    history=events,
    split=st.integers(0, 14),
    max_extensions=st.integers(0, 2),
    min_regions=st.integers(1, 3),
)
def test_restart_mid_round_gives_the_same_decisions(
    history, split, max_extensions, min_regions
) -> None:
    state = make_round(max_extensions=max_extensions, min_regions=min_regions)
    now = T0
    times = []
    for event in history:
        now += event[3]
        times.append(now)
    split = min(split, len(history))
    for event, at in zip(history[:split], times[:split], strict=True):
        apply(state, event, at)
    restored = reload(state)
    assert restored == state
    for event, at in zip(history[split:], times[split:], strict=True):
        assert apply(restored, event, at) == apply(state, event, at)
    assert restored.to_dict() == state.to_dict()
    # Invariants that hold whatever happened.
    assert len(set(state.delivered)) == len(state.delivered)
    if state.phase in (RoundPhase.AGGREGATING, RoundPhase.PUBLISHED):
        assert len(state.included) >= min_regions
        assert set(state.included) | set(state.stragglers) == set(REGIONS)


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: d["arrivals"].append({"region": "sa-east", "at": T0}), "non-participant"),
        (lambda d: d.update(phase="aggregating"), "needs closed_at, included and stragglers"),
        (lambda d: d.update(phase="failed"), "needs ended_at"),
        (lambda d: d.update(extensions=5), "exceed max_extensions"),
        (lambda d: d.update(phase="exploded"), "Input should be 'collecting'"),
        (lambda d: d.pop("config"), "config"),
    ],
)
def test_damaged_saved_state_is_refused(mutate, needle) -> None:
    state = make_round()
    state.on_delta("eu-west", 5, T0 + 1)
    data = state.to_dict()
    mutate(data)
    with pytest.raises(RoundStateError, match=needle):
        RoundState.from_dict(data)
