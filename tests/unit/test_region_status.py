"""Which region status the coordinator holds: a Last Will wins over what it outlived."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from coordinator.rounds.region_status import RegionView, take_status
from geofed.control import RegionStatus
from geofed.control.messages import RegionState

START = datetime(2026, 1, 1, tzinfo=UTC)


def status(state: RegionState, at_s: float) -> RegionStatus:
    return RegionStatus(
        region="eu-west",
        state=state,
        agent_version="geofed-agent/test",
        sent_at=START + timedelta(seconds=at_s),
    )


def held_after(*statuses: RegionStatus) -> RegionView | None:
    view: RegionView | None = None
    for each in statuses:
        taken, _ = take_status(view, each)
        view = taken if taken is not None else view
    return view


def test_the_first_status_is_taken() -> None:
    view, reason = take_status(None, status("online", 0))
    assert view is not None
    assert view.up
    assert reason == "the first status of the region"


def test_a_will_registered_at_connect_wins_over_the_statuses_it_outlived() -> None:
    # The Will of a connection made at 0 s, published by the broker after a kill at 60 s.
    view = held_after(status("online", 1), status("training", 30), status("training", 59))
    will = status("offline", 0)
    taken, reason = take_status(view, will)
    assert taken is not None
    assert not taken.up
    assert taken.status == will
    assert reason == "offline: the connection it came from is gone"
    # What it outlived still bounds what a late delivery may replace it with.
    assert taken.newest_sent_at == START + timedelta(seconds=59)


def test_a_restarted_agent_replaces_the_will() -> None:
    view = held_after(status("training", 59), status("offline", 0))
    taken, _ = take_status(view, status("online", 70))
    assert taken is not None
    assert taken.up


def test_a_live_status_delivered_late_does_not_replace_the_will() -> None:
    view = held_after(status("training", 59), status("offline", 0))
    kept, reason = take_status(view, status("training", 30))
    assert kept is None
    assert reason == "older than a status already taken: delivered late"
    assert view is not None
    assert not view.up


def test_a_late_live_status_is_ignored_and_an_equal_time_is_taken() -> None:
    view = held_after(status("training", 10))
    assert take_status(view, status("online", 5))[0] is None
    taken, _ = take_status(view, status("uploading", 10))
    assert taken is not None
    assert taken.status.state == "uploading"


def test_a_goodbye_is_taken_like_a_will() -> None:
    view = held_after(status("training", 10), status("offline", 11))
    assert view is not None
    assert not view.up
    assert view.newest_sent_at == START + timedelta(seconds=11)


RUN_A, RUN_B = "a" * 32, "b" * 32
YEAR_S = 365 * 86400.0


def numbered(state: RegionState, at_s: float, boot: str, seq: int) -> RegionStatus:
    return status(state, at_s).model_copy(update={"boot": boot, "seq": seq})


def test_a_clock_far_ahead_does_not_pin_the_region() -> None:
    # A host a year ahead, then its clock corrected: its run's statuses go on by number.
    view = held_after(numbered("training", YEAR_S, RUN_A, 1))
    taken, reason = take_status(view, numbered("uploading", 10, RUN_A, 2))
    assert taken is not None
    assert taken.status.state == "uploading"
    assert reason == "the run's next status"
    # It dies: the Will is taken; its restart (a new run, clock still behind) replaces it.
    view = held_after(
        numbered("training", YEAR_S, RUN_A, 1),
        status("offline", 0),
        numbered("online", 20, RUN_B, 1),
    )
    assert view is not None
    assert view.up
    assert (view.boot, view.seq, view.retired) == (RUN_B, 1, (RUN_A,))


def test_a_late_status_of_a_run_is_dropped_by_its_number_not_its_clock() -> None:
    view = held_after(numbered("training", 0, RUN_A, 5), status("offline", 0))
    kept, reason = take_status(view, numbered("training", YEAR_S, RUN_A, 4))
    assert kept is None
    assert reason == "an earlier status of the same agent run: delivered late"
    view = held_after(numbered("training", 0, RUN_A, 5), numbered("online", 1, RUN_B, 1))
    kept, reason = take_status(view, numbered("training", YEAR_S, RUN_A, 6))
    assert kept is None
    assert reason == "a status of an earlier run of the agent: delivered late"
