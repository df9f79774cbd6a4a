"""Late deltas merged into a later round: their weight, and how long a round waits. Pure.

A job with ``aggregation.late: merge`` takes a delta that missed its round r into the
round r + s collecting when it arrives (:func:`coordinator.rounds.state.judge_delta`),
``s`` (its staleness) at most ``max_staleness``. It was trained from θ_r, s outer steps
behind, so it weighs less than a fresh delta of as many tokens::

    weight = tokens / (1 + s)

the discount of asynchronous federated averaging's hinge-free polynomial rule (FedAsync,
a = 1) and of the staleness-aware outer step ``benchmarks/staleness.py`` measures: one
round late halves a delta's say, two rounds a third. The round's mean divides by the sum
of the weights, fresh and late, so a late delta never scales the update up.

Since a straggler's work is no longer lost, a round need not wait for it: once its
quorum arrived it waits a grace window (:func:`grace_window`) for the regions close
behind, then closes; what comes after merges into the next round. Nor does it wait for a
participant whose agent says it is still at an earlier round (:func:`still_behind`): that
region delivers the earlier round first, merged here, and this one only after.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from statistics import median, quantiles
from typing import Protocol

from coordinator.rounds.deadline import RoundTiming
from geofed.control.messages import RegionStatus
from geofed.types import InvalidName, validate_name

__all__ = [
    "GRACE_QUANTILE",
    "MIN_GRACE_S",
    "grace_window",
    "late_key",
    "staleness_factor",
    "still_behind",
    "validate_key",
]

#: The states in which an agent is at work on the round its status names.
_AT_WORK = frozenset({"syncing", "training", "uploading"})

#: The share of the recent after-quorum arrivals the grace window is sized to cover
#: (then doubled, so that the window does not shrink onto the arrivals it let in).
GRACE_QUANTILE = 0.9
#: The shortest grace window: below it, clock noise decides who is a straggler.
MIN_GRACE_S = 1.0
#: Fewer slack samples than this size the window from the quorum's arrival time instead.
_MIN_SLACK_SAMPLES = 3


def late_key(region: str, round: int) -> str:
    """The name a late delta has in the sum of the round that merges it."""
    return f"{region}@{round}"


def validate_key(key: str) -> str:
    """``key`` if it names a delta in a round's sum: a region, or a late delta's
    :func:`late_key`; :class:`~geofed.types.InvalidName` otherwise."""
    region, at, round = key.partition("@")
    validate_name("region", region)
    if at and not (round.isascii() and round.isdigit() and len(round) <= 19):
        raise InvalidName(f"invalid late delta {key!r}: use REGION@ROUND")
    return key


def staleness_factor(staleness: int) -> float:
    """What a delta ``staleness`` rounds late is weighed by, against its tokens."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return 1.0 / (1 + staleness)


class _HeldStatus(Protocol):
    @property
    def status(self) -> RegionStatus: ...


def still_behind(
    views: Mapping[str, _HeldStatus],
    job: str,
    round: int,
    received: Collection[tuple[str, int]] = (),
) -> frozenset[str]:
    """The regions whose latest status says they are at work on an earlier round of
    ``job`` than ``round`` and whose delta for it is not among the ``received`` (region,
    round) pairs: their delta for ``round`` can only come after that one. (A status
    naming a round whose delta arrived is merely older than the region's next.)"""
    return frozenset(
        region
        for region, view in views.items()
        if view.status.job == job
        and view.status.round is not None
        and view.status.round < round
        and view.status.state in _AT_WORK
        and (region, view.status.round) not in received
    )


def grace_window(
    history: Sequence[RoundTiming], quorum: int, configured_s: float | None
) -> tuple[float | None, str]:
    """How long the next round waits after its ``quorum`` arrived, and why.

    ``configured_s`` (the job's ``grace_s``) wins. Otherwise the window is sized from the
    recent rounds' ``history``: each arrival after the quorum's is a slack sample (how far
    behind the quorum it came), and the window is twice their 0.9-quantile; with fewer
    than three samples (the last regions came too late to count, or never), half the
    median time the quorum took to arrive. None, without any history: the round waits
    for its deadline, as one that does not merge.
    """
    if configured_s is not None:
        return configured_s, f"grace window {configured_s:g} s, set by the job"
    slacks: list[float] = []
    quorum_times: list[float] = []
    for timing in history:
        arrivals = sorted(max(0.0, a) for a in timing.arrivals_s)
        if len(arrivals) < quorum:
            continue
        reached = arrivals[quorum - 1]
        quorum_times.append(reached)
        slacks.extend(a - reached for a in arrivals[quorum:])
    if len(slacks) >= _MIN_SLACK_SAMPLES:
        cover = quantiles(slacks, n=10, method="inclusive")[int(GRACE_QUANTILE * 10) - 1]
        value = max(MIN_GRACE_S, 2 * cover)
        return value, (
            f"grace window {value:.1f} s: twice the {GRACE_QUANTILE:g}-quantile "
            f"({cover:.1f} s) of {len(slacks)} arrivals' lag behind the quorum"
        )
    if quorum_times:
        mid = median(quorum_times)
        value = max(MIN_GRACE_S, mid / 2)
        return value, (
            f"grace window {value:.1f} s: half the median {mid:.1f} s the quorum took to "
            f"arrive over {len(quorum_times)} round(s) (only {len(slacks)} later arrival(s))"
        )
    return None, "no round measured yet: the round waits for its deadline"
