"""The round timeline: phases per (job, round), when a round is over, the bounded log."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from regional_agent.handoff.errors import InvalidHandoffData
from regional_agent.handoff.messages import RoundSummary
from regional_agent.metrics import AgentMetrics, MetricsError
from regional_agent.rounds.timeline import (
    FILE_NAME,
    Interval,
    RoundTimeline,
    Timeline,
    TimelineBook,
    TimelineError,
    TimelineLog,
    read_timeline,
    trimmed,
)


class FakeClock:
    """The wall clock, advanced by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _run_round(book: TimelineBook, clock: FakeClock, round_: int) -> None:
    with book.phase("job-a", round_, "sync"):
        clock.advance(2)
    with book.phase("job-a", round_, "train"):
        book.worker_trained("job-a", round_, clock.now + 0.5, clock.now + 9.5)
        clock.advance(10)
    with book.phase("job-a", round_, "encode"):
        clock.advance(1)
    with book.phase("job-a", round_, "upload"):
        clock.advance(3)
    book.accepted("job-a", round_)


def test_a_round_is_over_when_the_next_one_is_announced() -> None:
    clock = FakeClock()
    book = TimelineBook(clock)
    _run_round(book, clock, 4)
    assert book.announced("job-a", 4) == []  # a repeat of its own announcement
    clock.advance(5)
    assert book.announced("job-b", 5) == []  # another job's rounds do not end it
    (done,) = book.announced("job-a", 5)
    assert (done.job, done.round) == ("job-a", 4)
    assert {name: done.seconds(name) for name in done.phases} == {
        "sync": 2,
        "train": 10,
        "encode": 1,
        "upload": 3,
        "wait": 5,
    }
    assert done.phases["sync"] == Interval(1000, 1002, 2)
    assert done.phases["wait"] == Interval(1016, 1021, 5)
    assert done.worker == Interval(1002.5, 1011.5, 9)
    assert book.announced("job-a", 6) == []  # written once


def test_an_upload_that_ends_after_the_next_announcement_is_written_once() -> None:
    clock = FakeClock()
    book = TimelineBook(clock)
    with book.phase("job-a", 0, "train"):
        clock.advance(10)
    with book.phase("job-a", 0, "upload"):
        clock.advance(3)
        # The coordinator accepted the delta and announced round 1 before the answer.
        (done,) = book.announced("job-a", 1)
        clock.advance(1)
    book.accepted("job-a", 0)
    assert (done.round, done.seconds("upload"), done.seconds("wait")) == (0, 3, 0)
    # Nothing of round 0 is left to be written again with a later round.
    assert book.announced("job-a", 2, final=True) == []


def test_a_round_never_accepted_has_no_wait_and_a_final_announcement_ends_all() -> None:
    clock = FakeClock()
    book = TimelineBook(clock)
    with book.phase("job-a", 1, "sync"):
        clock.advance(1)
    _run_round(book, clock, 2)
    clock.advance(4)
    first, second = book.announced("job-a", 2, final=True)
    assert first.round == 1
    assert "wait" not in first.phases
    assert first.worker is None
    assert second.round == 2
    assert second.seconds("wait") == 4


def test_an_announcement_before_the_acceptance_answer_means_no_wait() -> None:
    # The last delta's commit closes the round and the coordinator publishes the next one
    # at once: its announcement can reach the agent before the commit's answer does.
    clock = FakeClock()
    book = TimelineBook(clock)
    with book.phase("job-a", 3, "upload"):
        clock.advance(2)
    (done,) = book.announced("job-a", 4)
    assert done.phases["wait"] == Interval(1002, 1002, 0.0)
    book.accepted("job-a", 3)  # the answer, late: no second line for round 3
    clock.advance(1)
    assert book.announced("job-a", 5) == []


def _fail_upload(book: TimelineBook, clock: FakeClock) -> None:
    with book.phase("job-a", 0, "upload"):
        clock.advance(2)
        raise ConnectionError("the WAN dropped")


def test_repeated_pieces_of_a_phase_add_up_and_a_failed_block_still_counts() -> None:
    clock = FakeClock()
    book = TimelineBook(clock)
    for _ in range(2):
        with pytest.raises(ConnectionError):
            _fail_upload(book, clock)
        clock.advance(10)  # the backoff between attempts is not upload time
    (done,) = book.announced("job-a", 1)
    assert done.phases["upload"] == Interval(1000, 1014, 4)
    with pytest.raises(ValueError, match="unknown phase"):
        book.record("job-a", 0, "nap", 0, 1)  # type: ignore[arg-type]


def test_open_rounds_are_bounded_oldest_dropped_first() -> None:
    clock = FakeClock()
    book = TimelineBook(clock, max_open=2)
    for round_ in range(3):
        book.accepted("job-a", round_)
    assert [done.round for done in book.announced("job-a", 9)] == [1, 2]


def test_a_worker_interval_the_workers_did_not_report_is_left_out() -> None:
    book = TimelineBook(FakeClock())
    book.record("job-a", 0, "train", 4.0, 7.0)
    book.worker_trained("job-a", 0, None, 5.0)
    book.worker_trained("job-a", 0, 6.0, 5.0)
    (done,) = book.announced("job-a", 1)
    assert done.worker is None


def test_lines_round_trip_and_the_log_rotates_within_its_bound(tmp_path: Path) -> None:
    clock = FakeClock()
    book = TimelineBook(clock)
    log = TimelineLog(tmp_path, max_bytes=1200)
    for round_ in range(12):
        _run_round(book, clock, round_)
        log.append(book.announced("job-a", round_ + 1))
    line = (tmp_path / FILE_NAME).read_text().splitlines()[0]
    assert json.loads(line)["seconds"] == {
        "encode": 1,
        "sync": 2,
        "train": 10,
        "upload": 3,
        "wait": 0,
    }
    assert (tmp_path / FILE_NAME).stat().st_size <= 1200
    assert (tmp_path / (FILE_NAME + ".1")).stat().st_size <= 1200
    rounds = [done.round for done in read_timeline(tmp_path)]
    assert rounds == list(range(rounds[0], 12))
    assert rounds[0] > 0
    assert read_timeline(tmp_path)[-1].worker == Interval(clock.now - 13.5, clock.now - 4.5, 9)


def test_trimmed_keeps_the_newest_lines_that_fit() -> None:
    assert trimmed([b"aaaa", b"bb", b"cc"], 4) == [b"bb", b"cc"]
    assert trimmed([b"aaaa", b"bbbbbb"], 4) == [b"bbbbbb"]  # always the newest one


def test_reading_skips_a_cut_last_line_and_names_a_bad_one(tmp_path: Path) -> None:
    done = RoundTimeline("job-a", 3, {"sync": Interval(1, 2, 1)}, None)
    good = json.dumps(done.to_json())
    (tmp_path / FILE_NAME).write_text(good + "\n" + good[:20])
    assert read_timeline(tmp_path) == [done]
    (tmp_path / FILE_NAME).write_text(good + '\n{"job": "job-a", "round": -1}\n')
    with pytest.raises(TimelineError, match=rf"{FILE_NAME}:2: round must be"):
        read_timeline(tmp_path)
    bad = {**done.to_json(), "phases": {"sync": {"start": 2, "end": 1, "seconds": 1}}}
    (tmp_path / FILE_NAME).write_text(json.dumps(bad) + "\n")
    with pytest.raises(TimelineError, match="before start"):
        read_timeline(tmp_path)


def test_the_summary_carries_the_training_interval() -> None:
    summary = RoundSummary(
        job="job-a",
        round=3,
        steps=5,
        tokens=40,
        mean_loss=0.5,
        cursor=5,
        base_params_hash="b" * 64,
        params_hash="p" * 64,
        world_size=1,
        train_seconds=1.5,
    )
    assert RoundSummary.from_json(summary.to_json()).train_started_at is None
    timed = replace(summary, train_started_at=1.7e9, train_finished_at=1.7e9 + 1.5)
    assert RoundSummary.from_json(timed.to_json()) == timed
    with pytest.raises(InvalidHandoffData, match="train_started_at"):
        replace(summary, train_started_at=float("nan"))


def test_phase_seconds_are_exported_per_phase() -> None:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, "eu-west")
    metrics.round_phases("job-a", {"sync": 2.0, "wait": 40.0})
    labels = {"job": "job-a", "region": "eu-west"}
    count = "geofed_agent_round_phase_seconds_count"
    assert registry.get_sample_value(count, {**labels, "phase": "wait"}) == 1
    total = "geofed_agent_round_phase_seconds_sum"
    assert registry.get_sample_value(total, {**labels, "phase": "wait"}) == 40
    with pytest.raises(MetricsError, match="phase"):
        metrics.round_phases("job-a", {"nap": 1.0})
    with pytest.raises(MetricsError, match="finite"):
        metrics.round_phases("job-a", {"sync": -1.0})
    metrics.forget_job("job-a")
    assert registry.get_sample_value(count, {**labels, "phase": "wait"}) is None


async def test_the_daemon_timeline_writes_finished_rounds_off_the_loop(tmp_path: Path) -> None:
    clock = FakeClock()
    seen: list[int] = []

    def observe(done: RoundTimeline) -> None:
        seen.append(done.round)
        raise MetricsError("a refused metric does not stop the timeline")

    timeline = Timeline(tmp_path, clock=clock, on_round=observe)
    with timeline.phase("job-a", 0, "sync"):
        clock.advance(1)
    timeline.worker_trained("job-a", 0, 1001.0, 1003.0)
    timeline.accepted("job-a", 0)
    clock.advance(2)
    timeline.announced("job-a", 1)
    await timeline.flush()
    (done,) = read_timeline(tmp_path)
    assert seen == [0]
    assert done.seconds("wait") == 2
    assert done.worker == Interval(1001, 1003, 2)
