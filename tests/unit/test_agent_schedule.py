"""The agent's scheduling decisions: which round runs, when a running round stops."""

from __future__ import annotations

from datetime import timedelta

import pytest

from geofed.control import Command, RoundAnnouncement
from regional_agent.rounds.schedule import Running, Schedule, Stop
from tests.support.agent_schedule import REGION, T0, announce


def command(action: str, job: str | None = "llm") -> Command:
    return Command(action=action, job=job)  # type: ignore[arg-type]


def test_an_open_round_of_a_participant_runs_once() -> None:
    schedule = Schedule(REGION)
    assert schedule.next_round() is None
    first, second = announce(round_=1), announce(round_=2)
    schedule.offer(first, None)
    assert schedule.next_round() is first
    schedule.settle("llm", 1)
    assert schedule.next_round() is None
    schedule.offer(second, None)
    assert schedule.next_round() is second


def test_rounds_this_region_is_not_part_of_are_skipped() -> None:
    schedule = Schedule(REGION)
    schedule.offer(announce(participants=("us-east",)), None)
    assert schedule.next_round() is None


@pytest.mark.parametrize("state", ["closed", "done", "cancelled", "paused"])
def test_only_open_rounds_run(state: str) -> None:
    schedule = Schedule(REGION)
    schedule.offer(announce(state=state), None)
    assert schedule.next_round() is None


def test_an_older_announcement_does_not_replace_a_newer_one() -> None:
    schedule = Schedule(REGION)
    third = announce(round_=3)
    schedule.offer(third, None)
    assert schedule.offer(announce(round_=2), None) is None
    assert schedule.latest("llm") is third
    closed_earlier = announce(round_=3, state="closed", sent_at=T0)
    schedule.offer(closed_earlier, None)
    assert schedule.latest("llm") is third


def test_jobs_run_in_name_order() -> None:
    schedule = Schedule(REGION)
    schedule.offer(announce(job="zeta"), None)
    schedule.offer(announce(job="alpha"), None)
    found = schedule.next_round()
    assert found is not None
    assert found.job == "alpha"


@pytest.mark.parametrize(
    ("new", "uploading", "stops"),
    [
        (announce(round_=1, state="open", sent_at=T0 + timedelta(minutes=1)), False, False),
        (announce(round_=1, state="closed", sent_at=T0 + timedelta(minutes=1)), False, True),
        (announce(round_=1, state="closed", sent_at=T0 + timedelta(minutes=1)), True, False),
        (announce(round_=2), False, True),
        (announce(round_=2), True, False),
        (announce(round_=1, state="done", sent_at=T0 + timedelta(minutes=1)), True, False),
        (announce(round_=1, state="paused", sent_at=T0 + timedelta(minutes=1)), True, True),
        (announce(round_=1, state="cancelled", sent_at=T0 + timedelta(minutes=1)), True, True),
        (announce(round_=0, sent_at=T0 + timedelta(minutes=1)), True, True),
        (announce(job="other", round_=7, state="closed"), False, False),
        # The job merges late deltas one round behind: round 1's work still counts.
        (announce(round_=1, state="closed", max_staleness=1), False, False),
        (announce(round_=2, max_staleness=1), False, False),
        (announce(round_=2, state="closed", max_staleness=1), False, True),
        (announce(round_=3, max_staleness=2), False, False),
        (announce(round_=2, state="done", max_staleness=2), False, True),
        (announce(round_=2, state="paused", max_staleness=2), False, True),
    ],
    ids=[
        "same-round-again",
        "closed",
        "closed-while-uploading",
        "next-round",
        "next-round-while-uploading",
        "done-while-uploading",
        "paused",
        "cancelled",
        "rolled-back-while-uploading",
        "other",
        "closed-merging",
        "next-round-merging",
        "next-round-closed-too-stale",
        "two-rounds-on-within-reach",
        "done-merging",
        "paused-merging",
    ],
)
def test_when_a_running_round_stops(new: RoundAnnouncement, uploading: bool, stops: bool) -> None:
    schedule = Schedule(REGION)
    schedule.offer(announce(round_=1), None)
    stop = schedule.offer(new, Running("llm", 1, uploading))
    assert (stop is not None) == stops
    if stop is not None:
        assert stop.job == "llm"
        assert new.state in stop.reason


def test_pause_and_resume() -> None:
    schedule = Schedule(REGION)
    first = announce()
    schedule.offer(first, None)
    assert schedule.command(command("pause"), Running("llm", 1)) == Stop("llm", "pause requested")
    assert schedule.paused("llm")
    assert schedule.next_round() is None
    assert schedule.command(command("resume"), None) is None
    assert schedule.next_round() is first


def test_cancel_drops_the_job_for_good() -> None:
    schedule = Schedule(REGION)
    schedule.offer(announce(), None)
    assert schedule.command(command("cancel"), None) is None
    schedule.offer(announce(round_=2), None)
    assert schedule.next_round() is None


def test_resync_retries_a_settled_round_and_is_taken_once() -> None:
    schedule = Schedule(REGION)
    first = announce()
    schedule.offer(first, None)
    schedule.settle("llm", 1)  # e.g. it failed: the checkpoint did not give the hash
    assert schedule.command(command("resync"), None) is None
    assert schedule.next_round() is first
    assert schedule.take_resync("llm")
    assert not schedule.take_resync("llm")


def test_drain_runs_no_new_round() -> None:
    schedule = Schedule(REGION)
    schedule.offer(announce(), None)
    assert schedule.command(command("drain", job=None), Running("llm", 1)) is None
    assert schedule.draining
    assert schedule.next_round() is None


def test_a_checkpoint_ask_leaves_the_running_round_alone() -> None:
    schedule = Schedule(REGION)
    first = announce()
    schedule.offer(first, None)
    ask = Command(action="checkpoint", job="llm", round=1, reason="hardware risk")
    assert schedule.command(ask, Running("llm", 1)) is None
    assert schedule.next_round() is first


@pytest.mark.parametrize("end", ["done", "cancelled", "cancel command"])
def test_a_job_ends_when_announced_done_or_cancelled(end: str) -> None:
    schedule = Schedule(REGION)
    schedule.offer(announce(), None)
    assert not schedule.ended("llm")
    if end == "cancel command":
        schedule.command(command("cancel"), None)
    else:
        schedule.offer(announce(round_=2, state=end), None)
    assert schedule.ended("llm")
    assert not schedule.ended("other")


def test_a_round_reopened_with_a_new_deadline_runs_again_unless_accepted() -> None:
    schedule = Schedule(REGION)
    first = announce(round_=4)
    schedule.offer(first, None)
    schedule.settle("llm", 4, deadline=first.deadline)  # a straggler: round_closed
    assert schedule.next_round() is None
    again = announce(
        round_=4, deadline=first.deadline + timedelta(minutes=5), sent_at=T0 + timedelta(hours=1)
    )
    schedule.offer(again, None)
    assert schedule.next_round() is again  # re-opened after a pause or below quorum
    schedule.settle("llm", 4)  # accepted this time
    schedule.settle("llm", 4, deadline=again.deadline)  # a late report cannot undo that
    later = announce(
        round_=4, deadline=again.deadline + timedelta(minutes=5), sent_at=T0 + timedelta(hours=2)
    )
    schedule.offer(later, None)
    assert schedule.next_round() is None
    schedule.settle("llm", 3, deadline=first.deadline)  # an older round changes nothing
    assert schedule.next_round() is None
