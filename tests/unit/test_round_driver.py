"""The round driver's decision: every step the engine takes, and why, from the job's facts."""

from __future__ import annotations

import pytest

from coordinator.rounds.driver import Step, next_step
from coordinator.rounds.records import JobState
from coordinator.rounds.state import RoundConfig, RoundPhase, RoundState

T0 = 1_700_000_000.0
REGIONS = ("ap-south", "eu-west", "us-east")


def round_in(phase: RoundPhase, number: int = 5) -> RoundState:
    """Round ``number`` in ``phase``, reached the way the engine reaches it."""
    config = RoundConfig(
        round=number, participants=REGIONS, min_regions=2, opened_at=T0, deadline_s=600.0
    )
    state = RoundState.open(config)
    if phase is RoundPhase.COLLECTING:
        return state
    if phase is RoundPhase.ABANDONED:
        state.abandon(T0 + 1, "job paused by an operator")
        return state
    if phase is RoundPhase.FAILED:
        state.tick(T0 + 600)  # extended: nobody delivered
        state.tick(T0 + 900)
        assert state.phase is RoundPhase.FAILED
        return state
    for region in REGIONS:
        state.on_delta(region, number, T0 + 10)
    state.tick(T0 + 11)
    if phase is RoundPhase.PUBLISHED:
        state.mark_published(T0 + 12)
    assert state.phase is phase
    return state


RUNNING, PAUSED, CANCELLED = JobState.RUNNING, JobState.PAUSED, JobState.CANCELLED
COMPLETED, FAILED = JobState.COMPLETED, JobState.FAILED
COLLECTING, AGGREGATING = RoundPhase.COLLECTING, RoundPhase.AGGREGATING
PUBLISHED, ROUND_FAILED, ABANDONED = RoundPhase.PUBLISHED, RoundPhase.FAILED, RoundPhase.ABANDONED

NOW = T0 + 1000
LATER = NOW + 7.5


@pytest.mark.parametrize(
    ("job_state", "version", "phase", "retry_at", "failures", "step", "reason"),
    [
        # A failed job is driven no further, whatever its round.
        (FAILED, 5, AGGREGATING, None, 0, Step.END, "the job failed: nothing more to drive"),
        (FAILED, 5, COLLECTING, None, 0, Step.END, "the job failed: nothing more to drive"),
        # A closed round is published whatever was asked since it closed.
        (RUNNING, 5, AGGREGATING, None, 0, Step.PUBLISH, "round 5 closed: publish it"),
        (CANCELLED, 5, AGGREGATING, None, 0, Step.PUBLISH, "round 5 closed: publish it"),
        (PAUSED, 5, AGGREGATING, None, 0, Step.PUBLISH, "round 5 closed: publish it"),
        (COMPLETED, 5, AGGREGATING, None, 0, Step.PUBLISH, "round 5 closed: publish it"),
        # ... unless its publication failed and waits for the next try.
        (
            RUNNING,
            5,
            AGGREGATING,
            LATER,
            0,
            Step.AWAIT_RETRY,
            "round 5 waits 7.5 s for the next try to publish it",
        ),
        (RUNNING, 5, AGGREGATING, NOW, 0, Step.PUBLISH, "the next try to publish round 5 is due"),
        (
            RUNNING,
            5,
            AGGREGATING,
            NOW - 1,
            0,
            Step.PUBLISH,
            "the next try to publish round 5 is due",
        ),
        (CANCELLED, 5, AGGREGATING, LATER, 0, Step.CANCEL, "job cancelled by an operator"),
        (CANCELLED, 5, AGGREGATING, NOW - 1, 0, Step.CANCEL, "job cancelled by an operator"),
        (PAUSED, 5, AGGREGATING, LATER, 0, Step.PAUSE, "job paused by an operator"),
        (PAUSED, 5, AGGREGATING, NOW - 1, 0, Step.PAUSE, "job paused by an operator"),
        # A cancel abandons the collecting round; it comes before everything else.
        (CANCELLED, 5, COLLECTING, None, 0, Step.CANCEL, "job cancelled by an operator"),
        (CANCELLED, 20, PUBLISHED, None, 0, Step.CANCEL, "job cancelled by an operator"),
        (CANCELLED, 5, None, None, 0, Step.CANCEL, "job cancelled by an operator"),
        # A job past its last round is finished, paused or not.
        (RUNNING, 20, PUBLISHED, None, 0, Step.COMPLETE, "the job ran all its 20 round(s)"),
        (PAUSED, 20, PUBLISHED, None, 0, Step.COMPLETE, "the job ran all its 20 round(s)"),
        (COMPLETED, 20, PUBLISHED, None, 0, Step.COMPLETE, "the job ran all its 20 round(s)"),
        (COMPLETED, 7, PUBLISHED, None, 0, Step.COMPLETE, "the job is completed"),
        # A pause abandons the collecting round and holds.
        (PAUSED, 5, COLLECTING, None, 0, Step.PAUSE, "job paused by an operator"),
        (PAUSED, 5, ABANDONED, None, 0, Step.PAUSE, "job paused by an operator"),
        (PAUSED, 0, None, None, 0, Step.PAUSE, "job paused by an operator"),
        # Without a collecting round of the current version one is opened.
        (RUNNING, 0, None, None, 0, Step.OPEN, "round 0 is not open yet"),
        (RUNNING, 6, PUBLISHED, None, 0, Step.OPEN, "round 6 is not open yet"),
        (RUNNING, 5, ABANDONED, None, 0, Step.OPEN, "round 5 is abandoned: open it again"),
        (RUNNING, 5, ROUND_FAILED, None, 1, Step.OPEN, "round 5 is failed: open it again"),
        (RUNNING, 5, ROUND_FAILED, None, 2, Step.OPEN, "round 5 is failed: open it again"),
        # ... unless it already failed max_round_attempts (3) times.
        (
            RUNNING,
            5,
            ROUND_FAILED,
            None,
            3,
            Step.FAIL,
            "round 5 failed 3 time(s); last: deadline passed with 0 of 3 delivered, below "
            "quorum 2 after 1 extension(s); round 5 failed",
        ),
        (
            RUNNING,
            5,
            ABANDONED,
            None,
            4,
            Step.FAIL,
            "round 5 failed 4 time(s); last: job paused by an operator",
        ),
        # A collecting round is ticked: the round decides.
        (RUNNING, 5, COLLECTING, None, 0, Step.TICK, "round 5 is collecting"),
        (RUNNING, 5, COLLECTING, None, 9, Step.TICK, "round 5 is collecting"),
    ],
)
def test_next_step(
    job_state: JobState,
    version: int,
    phase: RoundPhase | None,
    retry_at: float | None,
    failures: int,
    step: Step,
    reason: str,
) -> None:
    number = version - 1 if phase is RoundPhase.PUBLISHED else version
    rs = None if phase is None else round_in(phase, number)
    decided = next_step(
        NOW, job_state, version, 20, rs, retry_at, failures=failures, max_round_attempts=3
    )
    assert decided == (step, reason)


@pytest.mark.parametrize("phase", [COLLECTING, AGGREGATING, ROUND_FAILED, ABANDONED])
def test_a_round_of_another_version_is_not_the_current_round(phase: RoundPhase) -> None:
    # The record of round 4 (never the case for a closed round in practice) does not stand
    # for round 5: the engine opens round 5.
    decided = next_step(
        NOW, RUNNING, 5, 20, round_in(phase, 4), None, failures=9, max_round_attempts=3
    )
    assert decided == (Step.OPEN, "round 5 is not open yet")


def test_the_decision_reads_its_inputs_only() -> None:
    rs = round_in(COLLECTING)
    before = rs.to_dict()
    args = (NOW, RUNNING, 5, 20, rs, None)
    first = next_step(*args, failures=0, max_round_attempts=3)
    assert next_step(*args, failures=0, max_round_attempts=3) == first
    assert rs.to_dict() == before
