"""The drain decision on SIGTERM: finish the round within the grace, or stop it now."""

from __future__ import annotations

import pytest

from regional_agent.drain import SAFETY, RoundPosition, decide


def position(
    steps_done: int = 40,
    inner_steps: int = 100,
    step_s: float | None = 1.0,
    tail_s: float | None = 10.0,
) -> RoundPosition:
    return RoundPosition("llm", 3, steps_done, inner_steps, step_s, tail_s)


# (case, position, seconds since the notice, grace, finish?, words in the reason)
CASES = [
    ("no round", None, 0.0, 120.0, False, "no round in progress"),
    ("grace 0", position(), 0.0, 0.0, False, "no drain grace"),
    # 60 steps x 1 s + 10 s = 70 s; x1.25 = 87.5 s <= 120 s
    ("fits", position(), 0.0, 120.0, True, "finishing (60 steps"),
    # the same work, decided 40 s after the notice: 87.5 s > 80 s left
    ("fits no longer", position(), 40.0, 120.0, False, "stopping at the next step"),
    ("too long", position(steps_done=0), 0.0, 120.0, False, "100 steps at 1 s"),
    ("never measured", position(step_s=None), 0.0, 120.0, False, "no step time measured"),
    # training done (uploading): only the delivery is left, step time not needed
    ("delivering", position(steps_done=100, step_s=None), 0.0, 120.0, True, "0 steps"),
    ("delivery unmeasured", position(tail_s=None), 0.0, 120.0, True, "delivery unmeasured"),
    ("grace over", position(), 130.0, 120.0, False, "grace is over"),
]


@pytest.mark.parametrize(
    ("where", "at", "after_s", "grace_s", "finish", "reason"), CASES, ids=[c[0] for c in CASES]
)
def test_the_decision_and_its_reason(
    where: str, at: RoundPosition | None, after_s: float, grace_s: float, finish: bool, reason: str
) -> None:
    decision = decide(at, notice_at=1000.0, now=1000.0 + after_s, grace_s=grace_s)
    assert decision.finish is finish, decision
    assert reason in decision.reason, decision.reason
    if at is not None and where != "no round":
        assert decision.reason.startswith("job llm round 3:"), decision.reason


def test_a_finished_round_is_bounded_by_the_grace_and_a_stopped_one_ends_now() -> None:
    finish = decide(position(), notice_at=1000.0, now=1005.0, grace_s=120.0)
    assert finish.finish
    assert finish.deadline == 1120.0
    stop = decide(position(steps_done=0), notice_at=1000.0, now=1005.0, grace_s=120.0)
    assert not stop.finish
    assert stop.deadline == 1005.0


def test_the_margin_is_applied_at_the_edge() -> None:
    work_s = 60 * 1.0 + 10.0
    exactly = decide(position(), notice_at=0.0, now=0.0, grace_s=SAFETY * work_s)
    assert exactly.finish
    short = decide(position(), notice_at=0.0, now=0.0, grace_s=SAFETY * work_s - 0.01)
    assert not short.finish
