"""What the round engine does next: a pure decision over the job's facts.

:func:`next_step` looks at the job's state, its current round and a pending publication
retry, and returns one :class:`Step` with the reason for it; the engine carries the step
out and asks again. It does no I/O and reads no clock: ``now`` is passed in (wall-clock
POSIX seconds, like the round's deadlines). Precedence, first match wins:

1. a failed job is driven no further; a queued job (waiting for capacity) has no round
   yet and waits until the engine is woken;
2. a closed round of the current version is published, whatever was asked since it
   closed. If its publication failed and waits for its next try, a cancel abandons it, a
   pause holds it (a resume then tries again at once), and otherwise it waits until the
   try is due;
3. a cancel abandons the collecting round;
4. a job past its last round (or already marked completed) is finished;
5. a pause abandons the collecting round and holds until the engine is woken;
6. without a collecting round of the current version one is opened, unless this round
   already failed ``max_round_attempts`` times: then the job fails;
7. otherwise the collecting round is ticked, and the round decides whether to close,
   extend, fail or wait (:meth:`coordinator.rounds.state.RoundState.tick`).
"""

from __future__ import annotations

from enum import StrEnum

from coordinator.rounds.records import JobState
from coordinator.rounds.state import RoundPhase, RoundState

__all__ = ["Step", "next_step"]


class Step(StrEnum):
    """One thing the engine does; the engine asks for the next step after each."""

    END = "end"  # the job failed: stop driving
    QUEUED = "queued"  # the job waits for capacity: sleep until woken (admitted or cancelled)
    PUBLISH = "publish"  # publish the closed round now
    AWAIT_RETRY = "await_retry"  # sleep until the failed publication's next try is due
    CANCEL = "cancel"  # abandon the round in progress, announce the cancel, stop driving
    PAUSE = "pause"  # abandon a collecting round, announce the pause, sleep until woken
    COMPLETE = "complete"  # the job ran all its rounds: finish it, stop driving
    FAIL = "fail"  # the round failed too often: fail the job
    OPEN = "open"  # open (or re-open) the round of the current version
    TICK = "tick"  # let the collecting round decide: close, extend, fail or wait


# Also the end reason of the round a cancel or a pause abandons.
_CANCELLED = "job cancelled by an operator"
_PAUSED = "job paused by an operator"


def next_step(
    now: float,
    job_state: JobState,
    version: int,
    rounds: int,
    round_state: RoundState | None,
    retry_at: float | None,
    *,
    failures: int,
    max_round_attempts: int,
) -> tuple[Step, str]:
    """The engine's next :class:`Step` and why (see the module docstring).

    ``version`` is the job's current round, ``rounds`` how many it runs, ``round_state``
    the last round it recorded (of any version) with ``failures`` failed attempts, and
    ``retry_at`` when a failed publication is tried again (None when none failed).
    """
    if job_state is JobState.FAILED:
        return Step.END, "the job failed: nothing more to drive"
    if job_state is JobState.QUEUED:
        return Step.QUEUED, "the job waits in the queue for capacity"
    rs = round_state
    current = rs is not None and rs.config.round == version
    if rs is not None and current and rs.phase is RoundPhase.AGGREGATING:
        if retry_at is None:
            return Step.PUBLISH, f"round {version} closed: publish it"
        if job_state is JobState.CANCELLED:
            return Step.CANCEL, _CANCELLED
        if job_state is JobState.PAUSED:
            return Step.PAUSE, _PAUSED
        if now >= retry_at:
            return Step.PUBLISH, f"the next try to publish round {version} is due"
        return (
            Step.AWAIT_RETRY,
            f"round {version} waits {retry_at - now:.1f} s for the next try to publish it",
        )
    if job_state is JobState.CANCELLED:
        return Step.CANCEL, _CANCELLED
    if version >= rounds:
        return Step.COMPLETE, f"the job ran all its {rounds} round(s)"
    if job_state is JobState.COMPLETED:
        return Step.COMPLETE, "the job is completed"
    if job_state is JobState.PAUSED:
        return Step.PAUSE, _PAUSED
    if rs is None or not current:
        return Step.OPEN, f"round {version} is not open yet"
    if rs.phase is not RoundPhase.COLLECTING:
        if failures >= max_round_attempts:
            return (
                Step.FAIL,
                f"round {version} failed {failures} time(s); last: {rs.end_reason}",
            )
        return Step.OPEN, f"round {version} is {rs.phase}: open it again"
    return Step.TICK, f"round {version} is collecting"
