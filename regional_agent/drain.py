"""Draining on SIGTERM (a spot or preemption notice): finish the round, or stop now.

A spot instance gets a notice (SIGTERM) some time before it is taken away. The agent
then finishes the round in progress if the rest of it fits in the configured grace,
and otherwise stops the worker group at once, at a step boundary (the workers agree on
a stop every step). There the workers keep the round's inner state (parameters, inner
optimizer state, step, RNG states and running totals:
:mod:`regional_agent.worker.inner_checkpoint`),
and the next start, asked for the same round from the same θ, resumes it at that step:
the steps trained before the notice are kept and the delta is bit-identical to an
uninterrupted round's. Asked for anything else, or with the state unreadable (or not
written within the worker group's stop), it retrains the round from the regional
checkpoint of the round before: a round cut short may lose its inner steps, never its
correctness.

:func:`decide` is the pure decision: the clock is passed in, and it returns its reason.
The estimate is the round's remaining inner steps at the job's measured step time plus
the measured time from the end of training to the delta's delivery (encode and upload),
times :data:`SAFETY`; with no step time measured yet it does not gamble and stops.
Whatever it decides, the agent stops the round at the grace's end
(:attr:`DrainDecision.deadline`), so ``TimeoutStopSec=`` of the unit must exceed the
grace plus the worker group's stop (see ``deploy/systemd/geofed-agent@.service``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field, StrictFloat, StrictInt

from geofed.config_sections import ConfigSection

__all__ = ["DEFAULT_GRACE_S", "SAFETY", "DrainConfig", "DrainDecision", "RoundPosition", "decide"]

#: Two minutes: the notice most clouds give a spot instance (AWS gives 120 s).
DEFAULT_GRACE_S = 120.0
#: Estimates are of past rounds; a round is finished only if it fits with this slack.
SAFETY = 1.25


class DrainConfig(ConfigSection):
    """The agent's ``drain`` section: how long a SIGTERM may wait for the round."""

    grace_s: StrictFloat | StrictInt = Field(
        default=DEFAULT_GRACE_S,
        ge=0,
        le=3600,
        description="seconds after SIGTERM the round in progress may take to finish "
        "(0: stop at the next step at once); TimeoutStopSec= must exceed it",
    )


@dataclass(frozen=True, slots=True)
class RoundPosition:
    """Where the round in progress is, and the job's measured pace.

    ``steps_done`` of ``inner_steps`` trained so far (all of them once training is over);
    ``step_s``: seconds per inner step (None: not measured yet); ``tail_s``: seconds
    from the end of training to the delta's delivery (None: not measured yet).
    """

    job: str
    round: int
    steps_done: int
    inner_steps: int
    step_s: float | None
    tail_s: float | None


@dataclass(frozen=True, slots=True)
class DrainDecision:
    """Finish the round (until ``deadline`` at the latest), or stop it now; and why."""

    finish: bool
    deadline: float
    reason: str


def decide(
    position: RoundPosition | None, *, notice_at: float, now: float, grace_s: float
) -> DrainDecision:
    """Decide at ``now`` whether the round at ``position`` can finish within the grace.

    ``notice_at`` is when SIGTERM arrived and ``now`` the present, on one clock; the grace
    runs from the notice. ``position`` None: no round is in progress.
    """
    deadline = notice_at + grace_s
    left = deadline - now
    if position is None:
        return DrainDecision(False, now, "no round in progress")
    where = f"job {position.job} round {position.round}"
    if grace_s <= 0:
        return DrainDecision(False, now, f"{where}: no drain grace configured")
    if left <= 0:
        return DrainDecision(False, now, f"{where}: the {grace_s:g} s grace is over")
    steps_left = max(position.inner_steps - position.steps_done, 0)
    if steps_left > 0 and position.step_s is None:
        return DrainDecision(
            False,
            now,
            f"{where}: {steps_left} steps left and no step time measured yet; "
            "stopping at the next step",
        )
    training_s = steps_left * (position.step_s or 0.0)
    tail_s = position.tail_s or 0.0
    needed = SAFETY * (training_s + tail_s)
    detail = (
        f"{steps_left} steps at {position.step_s or 0.0:.3g} s and "
        + (f"{tail_s:.3g} s to deliver" if position.tail_s is not None else "delivery unmeasured")
        + f": ~{needed:.3g} s with margin, {left:.3g} s of grace left"
    )
    if needed <= left:
        return DrainDecision(True, deadline, f"{where}: finishing ({detail})")
    return DrainDecision(False, now, f"{where}: stopping at the next step ({detail})")
