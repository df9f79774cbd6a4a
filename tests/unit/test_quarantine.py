"""Quarantine of failing or straggling regions: entry, cool-down, probation, selection."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from coordinator.rounds.quarantine import (
    Outcome,
    Quarantine,
    QuarantineConfig,
    QuarantineError,
)

T0 = 1_700_000_000.0
CONFIG = QuarantineConfig(max_consecutive_bad=3, cooldown_rounds=2)


def test_enters_after_consecutive_bad_rounds() -> None:
    q = Quarantine(CONFIG)
    first = q.record("eu-west", 1, Outcome.STRAGGLER, T0)
    assert not first.quarantined
    assert (
        first.reason
        == "eu-west: straggler in round 1 (1 of 3 consecutive bad rounds before quarantine)"
    )
    q.record("eu-west", 2, Outcome.FAILED, T0 + 10)
    third = q.record("eu-west", 3, Outcome.STRAGGLER, T0 + 20)
    assert third.quarantined
    assert third.changed
    assert third.reason == (
        "eu-west quarantined until round 6: 3 consecutive bad rounds, the last straggler in round 3"
    )
    status = q.status("eu-west", 4, T0 + 30)
    assert status.quarantined
    assert status.reason.startswith("eu-west is quarantined until round 6: 3 consecutive")


def test_a_good_round_resets_the_count() -> None:
    q = Quarantine(CONFIG)
    q.record("eu-west", 1, Outcome.STRAGGLER, T0)
    q.record("eu-west", 2, Outcome.STRAGGLER, T0)
    assert q.record("eu-west", 3, Outcome.DELIVERED, T0).reason == "eu-west delivered round 3"
    assert not q.record("eu-west", 4, Outcome.STRAGGLER, T0).quarantined
    assert not q.record("eu-west", 5, Outcome.STRAGGLER, T0).quarantined
    assert q.record("eu-west", 6, Outcome.STRAGGLER, T0).quarantined


def quarantined_at_round_3(config: QuarantineConfig = CONFIG) -> Quarantine:
    q = Quarantine(config)
    for r in (1, 2, 3):
        q.record("eu-west", r, Outcome.FAILED, T0 + r)
    return q


def test_released_after_the_cooldown_on_probation() -> None:
    q = quarantined_at_round_3()
    assert q.status("eu-west", 5, T0 + 100).quarantined  # rounds 4 and 5 sat out
    back = q.status("eu-west", 6, T0 + 100)
    assert not back.quarantined
    assert back.reason.startswith("eu-west is back on probation after: 3 consecutive")
    again = q.record("eu-west", 6, Outcome.STRAGGLER, T0 + 200)
    assert again.quarantined
    assert again.reason == (
        "eu-west quarantined until round 9: straggler in round 6 while on probation"
    )


def test_a_good_round_on_probation_clears_it() -> None:
    q = quarantined_at_round_3()
    cleared = q.record("eu-west", 6, Outcome.DELIVERED, T0 + 200)
    assert cleared.reason == "eu-west delivered round 6: back in good standing"
    assert not cleared.changed  # it was already out of quarantine, on probation
    assert q.status("eu-west", 7, T0).reason == "eu-west is in good standing"
    # Counting starts over: one bad round is no longer enough.
    assert not q.record("eu-west", 7, Outcome.STRAGGLER, T0).quarantined


def test_without_probation_it_takes_the_full_count_again() -> None:
    q = quarantined_at_round_3(
        QuarantineConfig(max_consecutive_bad=3, cooldown_rounds=2, probation=False)
    )
    assert not q.record("eu-west", 6, Outcome.STRAGGLER, T0 + 60).quarantined
    assert not q.record("eu-west", 7, Outcome.STRAGGLER, T0 + 70).quarantined
    assert q.record("eu-west", 8, Outcome.STRAGGLER, T0 + 80).quarantined


def test_cooldown_in_seconds() -> None:
    config = QuarantineConfig(max_consecutive_bad=1, cooldown_rounds=0, cooldown_s=3600)
    q = Quarantine(config)
    entered = q.record("us-east", 10, Outcome.FAILED, T0)
    assert entered.reason == (
        f"us-east quarantined until t={T0 + 3600:.3f}: 1 consecutive bad round, "
        "the last failed in round 10"
    )
    assert q.status("us-east", 50, T0 + 3599).quarantined
    assert not q.status("us-east", 11, T0 + 3600).quarantined


def test_cooldown_in_rounds_and_seconds_needs_both() -> None:
    config = QuarantineConfig(max_consecutive_bad=1, cooldown_rounds=2, cooldown_s=600)
    q = Quarantine(config)
    assert "until round 13 and t=" in q.record("us-east", 10, Outcome.FAILED, T0).reason
    assert q.status("us-east", 13, T0 + 599).quarantined
    assert q.status("us-east", 12, T0 + 10_000).quarantined
    assert not q.status("us-east", 13, T0 + 600).quarantined


def test_bad_round_while_admitted_early_restarts_the_cooldown() -> None:
    q = quarantined_at_round_3()
    held = q.record("eu-west", 4, Outcome.STRAGGLER, T0 + 40)
    assert held.quarantined
    assert not held.changed
    assert held.reason == (
        "eu-west quarantined until round 7: straggler in round 4 while still quarantined "
        "(admitted early); cool-down restarts"
    )
    early_good = quarantined_at_round_3().record("eu-west", 4, Outcome.DELIVERED, T0)
    assert not early_good.quarantined
    assert early_good.changed


def test_select_leaves_quarantined_regions_out() -> None:
    q = quarantined_at_round_3()
    selection = q.select(["us-east", "eu-west", "ap-south"], 4, T0, min_regions=2)
    assert selection.participants == ("ap-south", "us-east")
    assert list(selection.excluded) == ["eu-west"]
    assert selection.excluded["eu-west"].startswith("eu-west is quarantined until round 6")
    assert selection.reason == "2 eligible, 1 quarantined"


def test_select_admits_early_rather_than_stall_the_job() -> None:
    q = Quarantine(QuarantineConfig(max_consecutive_bad=1, cooldown_rounds=5))
    q.record("us-east", 3, Outcome.FAILED, T0 + 3)
    q.record("eu-west", 2, Outcome.FAILED, T0 + 2)  # due back sooner
    q.record("ap-south", 4, Outcome.FAILED, T0 + 4)
    selection = q.select(["us-east", "eu-west", "ap-south", "sa-east"], 5, T0 + 5, min_regions=3)
    assert selection.participants == ("eu-west", "sa-east", "us-east")
    assert list(selection.excluded) == ["ap-south"]
    assert selection.reason == (
        "1 eligible, 3 quarantined; quorum needs 3, so admitting eu-west, us-east early "
        "(due back soonest)"
    )
    short = q.select(["eu-west"], 5, T0 + 5, min_regions=2)
    assert short.participants == ("eu-west",)
    assert short.reason.endswith("only 1 candidate(s) for a quorum of 2")


def test_recording_is_idempotent_per_round() -> None:
    q = Quarantine(CONFIG)
    q.record("eu-west", 1, Outcome.STRAGGLER, T0)
    q.record("eu-west", 2, Outcome.STRAGGLER, T0)
    replay = q.record("eu-west", 2, Outcome.STRAGGLER, T0)
    assert replay.reason == "eu-west: round 2 was already recorded; ignored"
    assert not q.record("eu-west", 3, Outcome.DELIVERED, T0).quarantined
    with pytest.raises(QuarantineError, match="round 1 is older than the last recorded round 3"):
        q.record("eu-west", 1, Outcome.FAILED, T0)


@settings(max_examples=60, deadline=None)
@given(
    outcomes=st.lists(
        st.tuples(st.sampled_from(["eu-west", "us-east"]), st.sampled_from(list(Outcome))),
        max_size=20,
    ),
    split=st.integers(0, 20),
)
def test_saved_state_gives_the_same_decisions(outcomes, split) -> None:
    q = Quarantine(CONFIG)
    for i, (region, outcome) in enumerate(outcomes[:split]):
        q.record(region, i, outcome, T0 + i)
    restored = Quarantine.from_dict(CONFIG, json.loads(json.dumps(q.to_dict(), sort_keys=True)))
    for i, (region, outcome) in enumerate(outcomes[split:], start=split):
        assert restored.record(region, i, outcome, T0 + i) == q.record(region, i, outcome, T0 + i)
        assert restored.select(["eu-west", "us-east"], i + 1, T0 + i, 1) == q.select(
            ["eu-west", "us-east"], i + 1, T0 + i, 1
        )
    assert restored.to_dict() == q.to_dict()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("Eu West", 1, Outcome.FAILED, T0), "invalid region 'Eu West'"),
        (("eu-west", -1, Outcome.FAILED, T0), "round must be an integer >= 0"),
        (("eu-west", 1, Outcome.FAILED, float("nan")), "now must be a finite number"),
    ],
)
def test_bad_input_is_refused(args, needle) -> None:
    q = Quarantine(CONFIG)
    with pytest.raises(QuarantineError, match=needle):
        q.record(*args)
    assert q.to_dict() == {"regions": {}}


def test_unknown_outcome_is_refused() -> None:
    with pytest.raises(ValueError, match="'lost' is not a valid Outcome"):
        Quarantine(CONFIG).record("eu-west", 1, "lost", T0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({}, "must be a mapping with 'regions'"),
        ({"regions": {"BAD": {}}}, "record 'BAD' is invalid"),
        ({"regions": {"eu-west": {"consecutive_bad": -2}}}, "record 'eu-west' is invalid"),
        ({"regions": {"eu-west": {"quarantined_round": 3}}}, "needs both or neither"),
    ],
)
def test_damaged_saved_state_is_refused(data, needle) -> None:
    with pytest.raises(QuarantineError, match=needle):
        Quarantine.from_dict(CONFIG, data)


def test_config_needs_a_cooldown() -> None:
    with pytest.raises(ValidationError, match="a cool-down is needed"):
        QuarantineConfig(cooldown_rounds=0, cooldown_s=0)
