"""Is this delta acceptable? The rule against a job (what the upload path asks), its 409s,
and a delta sent again. The rule against a round alone is in ``test_round_state.py``."""

from __future__ import annotations

import pytest

from coordinator.errors import Conflict
from coordinator.rounds.acceptance import accepted_again, refusal
from coordinator.rounds.state import (
    DeltaVerdict,
    DeltaVerdictCode,
    JobIntake,
    RoundConfig,
    RoundState,
    RoundStateError,
    judge_delta,
)
from coordinator.state.store import Receipt

T0 = 1_700_000_000.0
RUNNING = JobIntake("llm", 5)


def make_round(number: int = 5) -> RoundState:
    config = RoundConfig(
        round=number,
        participants=("us-east", "eu-west", "ap-south"),
        min_regions=2,
        opened_at=T0,
        deadline_s=600.0,
    )
    return RoundState.open(config)


def closed_round() -> RoundState:
    state = make_round()
    state.on_delta("eu-west", 5, T0 + 10)
    state.on_delta("us-east", 5, T0 + 20)
    state.tick(T0 + 600)
    return state


@pytest.mark.parametrize(
    ("job", "region", "round_", "code", "reason"),
    [
        (
            JobIntake("llm", 5, "paused"),
            "eu-west",
            5,
            DeltaVerdictCode.LATE,
            "job llm is paused; it takes no deltas",
        ),
        (
            JobIntake("llm", 5, "cancelled"),
            "sa-east",
            9,
            DeltaVerdictCode.LATE,
            "job llm is cancelled; it takes no deltas",
        ),
        (
            RUNNING,
            "eu-west",
            4,
            DeltaVerdictCode.LATE,
            "round 4 of job llm is over; the current round is 5",
        ),
        (
            RUNNING,
            "eu-west",
            6,
            DeltaVerdictCode.WRONG_ROUND,
            "round 6 of job llm is not open (current round 5)",
        ),
        (
            RUNNING,
            "sa-east",
            5,
            DeltaVerdictCode.NOT_PARTICIPANT,
            "'sa-east' is not a participant of round 5 of job llm "
            "(participants: ap-south, eu-west, us-east)",
        ),
        (
            RUNNING,
            "eu-west",
            5,
            DeltaVerdictCode.ACCEPTED,
            "eu-west's delta accepted for round 5 of job llm at +1.000 s "
            "(1 of 3 delivered, quorum 2)",
        ),
    ],
)
def test_the_job_answers_first(
    job: JobIntake, region: str, round_: int, code: DeltaVerdictCode, reason: str
) -> None:
    state = make_round()
    verdict = judge_delta(state, region, round_, T0 + 1, job)
    assert verdict == DeltaVerdict(code, reason)
    assert state.delivered == ()  # judging records nothing


def test_without_an_open_round_of_the_current_version_nothing_is_taken() -> None:
    expected = DeltaVerdict(
        DeltaVerdictCode.WRONG_ROUND, "round 5 of job llm is not open (current round 5)"
    )
    assert judge_delta(None, "eu-west", 5, T0, RUNNING) == expected
    assert judge_delta(make_round(4), "eu-west", 5, T0, RUNNING) == expected


def test_a_round_alone_needs_a_round() -> None:
    with pytest.raises(RoundStateError, match="judged against its round, or against its job"):
        judge_delta(None, "eu-west", 5, T0)


def test_a_closed_round_takes_its_own_deltas_again_and_no_others() -> None:
    state = closed_round()
    again = judge_delta(state, "eu-west", 5, T0 + 700, RUNNING)
    assert again.code is DeltaVerdictCode.DUPLICATE
    assert again.accepted
    assert again.reason == (
        "eu-west's delta for round 5 of job llm was already accepted at +10.000 s; "
        "it is counted once"
    )
    late = judge_delta(state, "ap-south", 5, T0 + 700, RUNNING)
    assert late == DeltaVerdict(
        DeltaVerdictCode.LATE,
        "round 5 of job llm closed at +600.000 s without ap-south, counted as a straggler; "
        "its delta is not used, the region should join round 6",
    )


def test_an_ended_round_says_why() -> None:
    state = make_round()
    state.abandon(T0 + 5, "job paused by an operator")
    verdict = judge_delta(state, "eu-west", 5, T0 + 6, RUNNING)
    assert verdict == DeltaVerdict(
        DeltaVerdictCode.LATE,
        "round 5 of job llm is abandoned (job paused by an operator); it takes no more deltas",
    )


@pytest.mark.parametrize(
    ("code", "protocol_code"),
    [
        (DeltaVerdictCode.LATE, "round_closed"),
        (DeltaVerdictCode.NOT_PARTICIPANT, "not_participant"),
        (DeltaVerdictCode.WRONG_ROUND, "wrong_round"),
    ],
)
def test_refusals_are_the_protocols_409s(code: DeltaVerdictCode, protocol_code: str) -> None:
    error = refusal(DeltaVerdict(code, "why"))
    assert (error.status, error.code, error.message) == (409, protocol_code, "why")


@pytest.mark.parametrize("code", [DeltaVerdictCode.ACCEPTED, DeltaVerdictCode.DUPLICATE])
def test_an_acceptance_is_no_refusal(code: DeltaVerdictCode) -> None:
    with pytest.raises(ValueError, match="is not refused"):
        refusal(DeltaVerdict(code, "fine"))


RECEIPT = Receipt(
    job_id="llm",
    round=5,
    region="eu-west",
    manifest_digest="ab" * 32,
    blob_digest="cd" * 32,
    size=100,
    tokens=1000,
    received_at=T0,
)


def test_the_same_delta_sent_again_gets_its_receipt() -> None:
    assert accepted_again(RECEIPT, "ab" * 32, job="llm", round=5, region="eu-west") is RECEIPT


@pytest.mark.parametrize("existing", [RECEIPT, None])
def test_another_delta_is_already_accepted(existing: Receipt | None) -> None:
    with pytest.raises(Conflict) as caught:
        accepted_again(existing, "ef" * 32, job="llm", round=5, region="eu-west")
    assert caught.value.code == "already_accepted"
    assert caught.value.message == (
        "eu-west already has a different delta accepted for round 5 of job llm"
    )
