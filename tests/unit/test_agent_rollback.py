"""Telling a coordinator restored from an older backup from a stale announcement."""

from __future__ import annotations

from datetime import timedelta

from regional_agent.rounds.schedule import (
    Progress,
    Rollback,
    Running,
    Schedule,
    Stop,
    judge_lost_delta,
    judge_rollback,
)
from regional_agent.state import ParamsVersion
from tests.support.agent_schedule import REGION, T0, announce


def theta(round_: int, tag: int = 0) -> ParamsVersion:
    """θ of ``round_``; ``tag`` tells two histories' θ of the same round apart."""
    return ParamsVersion(round_, f"{round_ + (tag << 16):064x}")


AT_3 = Progress(params=theta(3), uploaded_round=3)


def test_a_restored_coordinator_at_the_announced_base_is_a_rollback() -> None:
    restored = announce(round_=1)
    assert judge_rollback(restored, AT_3, theta(1)) == Rollback("llm", 3, 1)


def test_a_stale_announcement_is_not_a_rollback_while_the_coordinator_is_past_it() -> None:
    replayed = announce(round_=1)
    assert judge_rollback(replayed, AT_3, theta(3)) is None
    assert judge_rollback(replayed, AT_3, theta(4)) is None
    # The coordinator restored, but not to what this message announces: the current
    # announcement will come, and decide.
    assert judge_rollback(replayed, AT_3, theta(2)) is None
    assert judge_rollback(replayed, AT_3, None) is None


def test_the_current_round_or_a_later_one_is_no_contradiction() -> None:
    for progress in (AT_3, Progress(theta(3), 2), Progress(theta(3), None), Progress(None, 2)):
        for round_ in (3, 4):
            assert not progress.contradicted_by(announce(round_=round_)), (progress, round_)
            assert judge_rollback(announce(round_=round_), progress, theta(round_)) is None
    # A round re-opened below quorum after this region's delta was accepted.
    assert not AT_3.contradicted_by(announce(round_=3))
    assert not Progress(None, None).contradicted_by(announce(round_=0))


def test_delivered_or_held_progress_past_the_base_contradicts() -> None:
    assert Progress(None, 2).contradicted_by(announce(round_=1))
    assert Progress(theta(2), None).contradicted_by(announce(round_=1))
    assert Progress(theta(2), None).reached == 2
    assert Progress(theta(1), 2).reached == 2


def test_the_same_round_delivered_from_another_history_is_a_rollback() -> None:
    # Restored to round 1 and re-run up to round 3 while this region was away: θ_3 now
    # has another hash, and this region's delivery of round 3 belongs to the old history.
    other = announce(round_=3, base_hash=theta(3, tag=1).hash)
    assert AT_3.contradicted_by(other)
    assert judge_rollback(other, AT_3, theta(3, tag=1)) == Rollback("llm", 3, 3)
    # Not delivered yet: the hash mismatch is an ordinary resync, no discard.
    assert not Progress(theta(3), 2).contradicted_by(other)


def test_a_coordinator_restored_before_the_regions_delta_asks_for_it_again() -> None:
    # Restored to round 2 with every delta of it: it publishes θ_3 again, the same θ
    # (deterministic aggregation), and opens round 3, which this region delivered.
    delivered_3 = Progress(theta(3), uploaded_round=3)
    again = announce(round_=3)
    assert not delivered_3.contradicted_by(again)
    assert delivered_3.delivered(again, REGION)
    assert judge_lost_delta(again, delivered_3, REGION, theta(3), {"us-east"}) == Rollback(
        "llm", 3, 3
    )


def test_a_round_announced_again_with_the_regions_delta_held_is_no_rollback() -> None:
    delivered_3 = Progress(theta(3), uploaded_round=3)
    again = announce(round_=3)
    assert judge_lost_delta(again, delivered_3, REGION, theta(3), {REGION}) is None
    # The coordinator moved on (or is at another round): the next announcement decides.
    assert judge_lost_delta(again, delivered_3, REGION, theta(4), set()) is None
    assert judge_lost_delta(again, delivered_3, REGION, theta(3), None) is None
    # Not delivered, not open, or not a participant: nothing was lost.
    assert judge_lost_delta(again, Progress(theta(3), 2), REGION, theta(3), set()) is None
    closed = announce(round_=3, state="closed")
    assert judge_lost_delta(closed, delivered_3, REGION, theta(3), set()) is None
    others = announce(round_=3, participants=("us-east",))
    assert judge_lost_delta(others, delivered_3, REGION, theta(3), set()) is None


def test_the_schedule_takes_an_earlier_round_sent_later_and_runs_it_again() -> None:
    schedule = Schedule(REGION)
    schedule.offer(announce(round_=3), None)
    schedule.settle("llm", 2)
    schedule.settle("llm", 3)
    restored = announce(round_=1, sent_at=T0 + timedelta(minutes=1))
    stop = schedule.offer(restored, Running("llm", 3))
    assert stop == Stop("llm", "round 1 is open")
    assert schedule.latest("llm") is restored
    assert schedule.next_round() is restored


def test_the_schedule_ignores_an_earlier_round_sent_earlier() -> None:
    schedule = Schedule(REGION)
    current = announce(round_=3)
    schedule.offer(current, None)
    schedule.settle("llm", 3)
    for stale in (announce(round_=1), announce(round_=2, sent_at=current.sent_at)):
        assert schedule.offer(stale, Running("llm", 3)) is None
        assert schedule.latest("llm") is current
        assert schedule.next_round() is None
