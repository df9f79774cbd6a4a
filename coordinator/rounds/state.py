"""The state machine of one round: who may deliver, when it closes, and why.

Phases::

    COLLECTING --tick: all delivered, or deadline passed at quorum--> AGGREGATING
    COLLECTING --tick: deadline passed below quorum--> (EXTEND, stays COLLECTING)
    COLLECTING --tick: below quorum, no extension left--> FAILED
    AGGREGATING --mark_published--> PUBLISHED
    COLLECTING | AGGREGATING --fail (e.g. aggregation error)--> FAILED
    COLLECTING | AGGREGATING --abandon (job cancelled)--> ABANDONED

Policy when the deadline passes: with at least ``min_regions`` deliveries the round
closes with them and the rest are stragglers. Below quorum it is extended up to
``max_extensions`` times by ``extension_s`` from the moment the passed deadline is
noticed (a region that is merely slow gets one more chance, the job does not stall on
one that is gone), then it fails; a failed round publishes nothing and the next one
starts from the same base.

Whether a delta is acceptable is stated once, by :func:`judge_delta`: against the round
alone, or first against its job (the upload path asks before it reads a byte). A job
that merges late deltas (``aggregation.late: merge``) takes a delta for an earlier
round, up to ``max_staleness`` behind, into the round collecting now: it is an
:class:`Arrival` that names its own round, outside the quorum and the participants'
count, summed at its staleness weight (:mod:`coordinator.rounds.late`). Such a round
closes ``grace_s`` after its quorum arrived rather than at its deadline.
Only :meth:`RoundState.tick` closes a round, so a delta that arrives after the deadline
but before the closing tick is still accepted; the daemon ticks at ``wake_at`` and first
thing after a restart. ``now`` is wall-clock POSIX seconds (the state outlives the
process). :meth:`RoundState.to_dict` gives JSON with ordered data in lists, so it survives
a store that sorts keys; :meth:`RoundState.from_dict` validates it back.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from coordinator.rounds.deadline import RoundTiming
from coordinator.rounds.late import late_key, staleness_factor
from geofed.types import validate_name

__all__ = [
    "Action",
    "Arrival",
    "DeltaVerdict",
    "DeltaVerdictCode",
    "JobIntake",
    "RoundConfig",
    "RoundDecision",
    "RoundPhase",
    "RoundState",
    "RoundStateError",
    "judge_delta",
]


class RoundStateError(ValueError):
    """An invalid transition, time or saved state; the round was not changed."""


class RoundPhase(StrEnum):
    COLLECTING = "collecting"
    AGGREGATING = "aggregating"
    PUBLISHED = "published"
    FAILED = "failed"
    ABANDONED = "abandoned"


class DeltaVerdictCode(StrEnum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"  # already accepted: not an error, the upload may answer 200 again
    NOT_PARTICIPANT = "not_participant"
    WRONG_ROUND = "wrong_round"  # not the round that is open
    LATE = "late"  # the round closed or ended without this region, or the job takes none
    MERGED = "merged"  # accepted into the open round, late (the job merges late deltas)
    NOT_YET = "not_yet"  # to be merged, but no round is collecting now: send it again later


@dataclass(frozen=True, slots=True)
class DeltaVerdict:
    """What to do with one uploaded delta, and why (see :func:`judge_delta`)."""

    code: DeltaVerdictCode
    reason: str

    @property
    def accepted(self) -> bool:
        """True when the delta is (or already was) part of a round."""
        return self.code in (
            DeltaVerdictCode.ACCEPTED,
            DeltaVerdictCode.DUPLICATE,
            DeltaVerdictCode.MERGED,
        )


@dataclass(frozen=True, slots=True)
class JobIntake:
    """The job's side of taking a delta: its name, its current round, whether it runs.

    ``stopped`` is the job's state while it takes no deltas (``paused``, ``cancelled``,
    ...), empty while it runs. ``max_staleness`` is how many rounds behind a late delta
    may be merged (0: the job drops late deltas); ``past`` holds the states of the
    published rounds within that reach, by number.
    """

    job: str
    version: int
    stopped: str = ""
    max_staleness: int = 0
    past: Mapping[int, RoundState] = field(default_factory=dict)


class Action(StrEnum):
    WAIT = "wait"
    CLOSE = "close"
    EXTEND = "extend"
    FAIL = "fail"
    IDLE = "idle"  # the round is no longer collecting; nothing to decide


@dataclass(frozen=True, slots=True)
class RoundDecision:
    """The outcome of one :meth:`RoundState.tick`; ``wake_at`` is when to tick again."""

    action: Action
    reason: str
    included: tuple[str, ...] = ()  # CLOSE: the regions to aggregate, sorted
    stragglers: tuple[str, ...] = ()  # CLOSE/EXTEND/FAIL: participants not delivered, sorted
    wake_at: float | None = None  # WAIT/EXTEND: the deadline to tick at


class RoundConfig(BaseModel):
    """The announced round: who participates, the quorum and the deadline."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    round: int = Field(ge=0, description="Round number r (its base is θ_r).")
    participants: tuple[str, ...] = Field(description="Regions asked to deliver; stored sorted.")
    min_regions: int = Field(ge=1, description="Quorum needed to close at the deadline.")
    opened_at: float = Field(allow_inf_nan=False, description="Announcement time.")
    deadline_s: float = Field(gt=0, allow_inf_nan=False, description="Announcement to deadline.")
    max_extensions: int = Field(default=1, ge=0, description="Extensions below quorum.")
    extension_s: float | None = Field(
        default=None, gt=0, allow_inf_nan=False, description="Default: half of deadline_s."
    )
    shards: dict[str, int] | None = Field(
        default=None,
        description="The job's regions when the round opened, each with its data shard slot "
        "(kept for the round's life, whoever joins or leaves meanwhile); None: a record that "
        "predates it.",
    )
    shard_count: int | None = Field(default=None, ge=1, description="The job's shard slots.")
    base_hash: str | None = Field(
        default=None,
        max_length=128,
        description="θ_r's parameters hash: a delta merged late into a later round is checked "
        "against it; None: a record that predates it.",
    )
    grace_s: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="Close this long after the quorum arrived (never past the deadline); "
        "None: at the deadline, or once all delivered.",
    )

    @field_validator("participants")
    @classmethod
    def _names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("a round needs at least one participant")
        for name in value:
            validate_name("region", name)
        if len(set(value)) != len(value):
            raise ValueError(f"participants are listed more than once: {sorted(value)}")
        return tuple(sorted(value))

    @model_validator(mode="after")
    def _quorum(self) -> RoundConfig:
        if self.min_regions > len(self.participants):
            raise ValueError(
                f"min_regions ({self.min_regions}) exceeds the {len(self.participants)} "
                "participants"
            )
        if (self.shards is None) != (self.shard_count is None):
            raise ValueError("shards and shard_count go together")
        if self.shards is not None and self.shard_count is not None:
            slots = list(self.shards.values())
            if len(set(slots)) != len(slots) or any(
                not 0 <= slot < self.shard_count for slot in slots
            ):
                raise ValueError(
                    f"shards {self.shards} are not distinct slots of {self.shard_count}"
                )
            if not set(self.participants) <= set(self.shards):
                raise ValueError("every participant needs a shard")
        return self

    @property
    def effective_extension_s(self) -> float:
        return self.extension_s if self.extension_s is not None else self.deadline_s / 2


class Arrival(BaseModel):
    """An accepted delta: its region, when, and for a late one the round it was trained for."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    region: str
    at: float = Field(allow_inf_nan=False)
    #: A late delta's own round (merged here, :mod:`coordinator.rounds.late`); None: this round's.
    round: int | None = Field(default=None, ge=0)

    @property
    def key(self) -> str:
        """Its name in the round's sum: the region, or ``region@round`` for a late one."""
        return self.region if self.round is None else late_key(self.region, self.round)


def _check_now(now: float) -> float:
    if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
        raise RoundStateError(f"now must be a finite number of seconds, got {now!r}")
    return float(now)


class RoundState(BaseModel):
    """Mutable state of one round; every method takes ``now`` and returns its reason."""

    model_config = ConfigDict(extra="forbid")

    config: RoundConfig
    phase: RoundPhase = RoundPhase.COLLECTING
    deadline_at: float = Field(allow_inf_nan=False)
    extensions: int = Field(default=0, ge=0)
    arrivals: list[Arrival] = Field(
        default_factory=list, description="In acceptance order, late deltas merged among them."
    )
    included: tuple[str, ...] = ()
    stragglers: tuple[str, ...] = ()
    closed_at: float | None = Field(default=None, allow_inf_nan=False)
    ended_at: float | None = Field(default=None, allow_inf_nan=False)
    end_reason: str = ""

    @classmethod
    def open(cls, config: RoundConfig) -> RoundState:
        """Start collecting for an announced round."""
        return cls(config=config, deadline_at=config.opened_at + config.deadline_s)

    @model_validator(mode="after")
    def _consistent(self) -> RoundState:
        cfg = self.config
        seen = list(self.delivered)
        if len(set(seen)) != len(seen) or not set(seen) <= set(cfg.participants):
            raise ValueError(f"arrivals {seen} repeat a region or name a non-participant")
        late = [a.key for a in self.merged]
        if len(set(late)) != len(late) or any((a.round or 0) >= cfg.round for a in self.merged):
            raise ValueError(f"late deltas {late} repeat one or are not of an earlier round")
        if self.extensions > cfg.max_extensions:
            raise ValueError(f"{self.extensions} extensions exceed max_extensions")
        closed = self.phase in (RoundPhase.AGGREGATING, RoundPhase.PUBLISHED)
        if closed and (
            self.closed_at is None
            or self.included != tuple(sorted(seen))
            or self.stragglers != tuple(sorted(set(cfg.participants) - set(seen)))
        ):
            raise ValueError(f"a {self.phase} round needs closed_at, included and stragglers")
        if not closed and self.phase is not RoundPhase.COLLECTING and self.ended_at is None:
            raise ValueError(f"a {self.phase} round needs ended_at")
        return self

    # -- queries ---------------------------------------------------------------

    @property
    def delivered(self) -> tuple[str, ...]:
        """Regions whose delta for this round was accepted, in acceptance order."""
        return tuple(a.region for a in self.arrivals if a.round is None)

    @property
    def merged(self) -> tuple[Arrival, ...]:
        """The late deltas of earlier rounds taken into this one, in acceptance order."""
        return tuple(a for a in self.arrivals if a.round is not None)

    @property
    def summed(self) -> tuple[str, ...]:
        """The keys (:attr:`Arrival.key`) of every delta the round sums, in acceptance
        order; empty until it closes."""
        if self.phase not in (RoundPhase.AGGREGATING, RoundPhase.PUBLISHED):
            return ()
        return tuple(a.key for a in self.arrivals)

    @property
    def missing(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.config.participants) - set(self.delivered)))

    def timing(self) -> RoundTiming | None:
        """Arrival timing for the adaptive deadline; None while collecting or if abandoned."""
        if self.phase in (RoundPhase.COLLECTING, RoundPhase.ABANDONED):
            return None
        opened = self.config.opened_at
        return RoundTiming(
            deadline_s=self.deadline_at - opened,
            arrivals_s=tuple(a.at - opened for a in self.arrivals if a.round is None),
            stragglers=len(self.missing),
        )

    # -- events ----------------------------------------------------------------

    def on_delta(self, region: str, round: int, now: float) -> DeltaVerdict:
        """Judge an uploaded delta (:func:`judge_delta`); record it when accepted."""
        verdict = judge_delta(self, region, round, now)
        if verdict.code is DeltaVerdictCode.ACCEPTED:
            self.arrivals.append(Arrival(region=region, at=float(now)))
        return verdict

    def merge(self, region: str, round: int, now: float) -> None:
        """Record ``region``'s late delta for the earlier ``round`` (judged ``MERGED``)."""
        now = _check_now(now)
        if self.phase is not RoundPhase.COLLECTING or round >= self.config.round:
            raise RoundStateError(
                f"round {self.config.round} ({self.phase}) cannot merge a delta of round {round}"
            )
        if any(a.region == region and a.round == round for a in self.arrivals):
            raise RoundStateError(f"{region}'s delta for round {round} is merged already")
        self.arrivals.append(Arrival(region=region, at=now, round=round))

    def tick(self, now: float, behind: Collection[str] = ()) -> RoundDecision:
        """Decide whether to keep waiting, close, extend or fail, and apply it.

        ``behind``: participants still at an earlier round, whose delta for it merges
        into this one (:func:`coordinator.rounds.late.still_behind`); at quorum the round
        does not wait for them."""
        now = _check_now(now)
        cfg = self.config
        if self.phase is not RoundPhase.COLLECTING:
            reason = f"round {cfg.round} is {self.phase}: nothing to decide"
            return RoundDecision(Action.IDLE, reason)
        count, total, missing = len(self.delivered), len(cfg.participants), self.missing
        if not missing:
            return self._close(now, f"all {total} participants delivered")
        late = sorted(set(missing) & set(behind))
        if late == list(missing) and count >= cfg.min_regions:
            return self._close(
                now,
                f"{count} of {total} participants delivered; {', '.join(late)} still at "
                f"an earlier round (what it sends for this one merges into round "
                f"{cfg.round + 1})",
            )
        if now < self.deadline_at:
            grace_end = self._grace_end()
            if grace_end is not None and now >= grace_end:
                return self._close(
                    now,
                    f"quorum {cfg.min_regions} reached and its grace window of "
                    f"{cfg.grace_s:g} s ended {_since_open(cfg, grace_end)} with {count} of "
                    f"{total} delivered; stragglers: {', '.join(missing)} (their deltas merge "
                    f"into round {cfg.round + 1})",
                )
            until = "the deadline"
            wake_at = self.deadline_at
            if grace_end is not None and grace_end < wake_at:
                until, wake_at = "the quorum's grace window ends", grace_end
            return RoundDecision(
                Action.WAIT,
                f"waiting for {len(missing)} of {total} participants ({', '.join(missing)}) "
                f"until {until} {_since_open(cfg, wake_at)}; {count} delivered, "
                f"quorum {cfg.min_regions}",
                wake_at=wake_at,
            )
        if count >= cfg.min_regions:
            return self._close(
                now,
                f"deadline passed with {count} of {total} participants delivered "
                f"(quorum {cfg.min_regions}); stragglers: {', '.join(missing)}",
            )
        below = f"deadline passed with {count} of {total} delivered, below quorum {cfg.min_regions}"
        if self.extensions < cfg.max_extensions:
            self.extensions += 1
            self.deadline_at = now + cfg.effective_extension_s
            return RoundDecision(
                Action.EXTEND,
                f"{below}; extension {self.extensions} of {cfg.max_extensions} by "
                f"{cfg.effective_extension_s:g} s, new deadline "
                f"{_since_open(cfg, self.deadline_at)}",
                stragglers=missing,
                wake_at=self.deadline_at,
            )
        reason = f"{below} after {self.extensions} extension(s); round {cfg.round} failed"
        self._end(RoundPhase.FAILED, now, reason)
        return RoundDecision(Action.FAIL, reason, stragglers=missing)

    def mark_published(self, now: float) -> None:
        """Record that the round's update is published and durable."""
        now = _check_now(now)
        if self.phase is not RoundPhase.AGGREGATING:
            raise RoundStateError(
                f"round {self.config.round} is {self.phase}; only an aggregating round "
                "can be published"
            )
        self._end(RoundPhase.PUBLISHED, now, "update published")

    def fail(self, now: float, reason: str) -> None:
        """End the round without an update (e.g. aggregation failed): the next starts anew."""
        self._finish(RoundPhase.FAILED, now, reason)

    def abandon(self, now: float, reason: str) -> None:
        """End the round because its job was cancelled or paused."""
        self._finish(RoundPhase.ABANDONED, now, reason)

    # -- persistence -----------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict (no NaN, ordered data in lists)."""
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: Any) -> RoundState:
        """Rebuild a state saved by :meth:`to_dict`; raise :class:`RoundStateError` if unusable."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise RoundStateError(f"saved round state is invalid: {exc}") from None

    # -- internals -------------------------------------------------------------

    def _grace_end(self) -> float | None:
        """When the grace window after the quorum ends; None without one (or no quorum)."""
        grace, quorum = self.config.grace_s, self.config.min_regions
        fresh = [a.at for a in self.arrivals if a.round is None]
        if grace is None or len(fresh) < quorum:
            return None
        return fresh[quorum - 1] + grace

    def _close(self, now: float, reason: str) -> RoundDecision:
        self.phase = RoundPhase.AGGREGATING
        self.closed_at = now
        self.included = tuple(sorted(self.delivered))
        self.stragglers = self.missing
        return RoundDecision(Action.CLOSE, reason, self.included, self.stragglers)

    def _finish(self, phase: RoundPhase, now: float, reason: str) -> None:
        now = _check_now(now)
        if self.phase not in (RoundPhase.COLLECTING, RoundPhase.AGGREGATING):
            raise RoundStateError(f"round {self.config.round} already ended as {self.phase}")
        if not reason:
            raise RoundStateError("a reason is required to end a round")
        self._end(phase, now, reason)

    def _end(self, phase: RoundPhase, now: float, reason: str) -> None:
        self.phase = phase
        self.ended_at = now
        self.end_reason = reason


def judge_delta(
    current: RoundState | None,
    region: str,
    round: int,
    now: float,
    job: JobIntake | None = None,
) -> DeltaVerdict:
    """Is ``region``'s delta for ``round`` acceptable now? The one statement of the rule.

    Against ``current`` alone it answers what the round takes. With the job's ``job``
    intake it first answers what the job takes: nothing while it is stopped, and only
    deltas for its current round, which ``current`` must be. A delta the round already
    holds is a duplicate, whatever the phase, so that its upload can be answered again.
    Read-only: :meth:`RoundState.on_delta` records an accepted delta.
    """
    now = _check_now(now)
    if job is not None:
        if job.stopped:
            return DeltaVerdict(
                DeltaVerdictCode.LATE, f"job {job.job} is {job.stopped}; it takes no deltas"
            )
        if round < job.version:
            if job.max_staleness:
                return _judge_late(current, region, round, job)
            return DeltaVerdict(
                DeltaVerdictCode.LATE,
                f"round {round} of job {job.job} is over; the current round is {job.version}",
            )
        if round > job.version or current is None or current.config.round != round:
            return DeltaVerdict(
                DeltaVerdictCode.WRONG_ROUND,
                f"round {round} of job {job.job} is not open (current round {job.version})",
            )
    if current is None:
        raise RoundStateError("a delta is judged against its round, or against its job")
    cfg = current.config
    n, of_job = cfg.round, f" of job {job.job}" if job is not None else ""
    if round != n:
        return DeltaVerdict(
            DeltaVerdictCode.WRONG_ROUND, f"delta is for round {round}, this is round {n}"
        )
    if region not in cfg.participants:
        return DeltaVerdict(
            DeltaVerdictCode.NOT_PARTICIPANT,
            f"{region!r} is not a participant of round {n}{of_job} "
            f"(participants: {', '.join(cfg.participants)})",
        )
    for arrival in current.arrivals:
        if arrival.region == region and arrival.round is None:
            return DeltaVerdict(
                DeltaVerdictCode.DUPLICATE,
                f"{region}'s delta for round {n}{of_job} was already accepted "
                f"{_since_open(cfg, arrival.at)}; it is counted once",
            )
    if current.phase in (RoundPhase.AGGREGATING, RoundPhase.PUBLISHED):
        closed = current.closed_at if current.closed_at is not None else current.deadline_at
        if job is not None and job.max_staleness:
            return DeltaVerdict(
                DeltaVerdictCode.NOT_YET,
                f"round {n}{of_job} closed {_since_open(cfg, closed)} without {region}; its "
                f"delta merges into round {n + 1}: send it again once that round opens",
            )
        return DeltaVerdict(
            DeltaVerdictCode.LATE,
            f"round {n}{of_job} closed {_since_open(cfg, closed)} without {region}, counted "
            f"as a straggler; its delta is not used, the region should join round {n + 1}",
        )
    if current.phase is not RoundPhase.COLLECTING:
        return DeltaVerdict(
            DeltaVerdictCode.LATE,
            f"round {n}{of_job} is {current.phase} ({current.end_reason}); it takes no more deltas",
        )
    return DeltaVerdict(
        DeltaVerdictCode.ACCEPTED,
        f"{region}'s delta accepted for round {n}{of_job} {_since_open(cfg, now)} "
        f"({len(current.delivered) + 1} of {len(cfg.participants)} delivered, "
        f"quorum {cfg.min_regions})",
    )


def _judge_late(
    current: RoundState | None, region: str, round: int, job: JobIntake
) -> DeltaVerdict:
    """A delta for ``round``, earlier than the job's, in a job that merges late deltas."""
    version, name = job.version, job.job
    staleness = version - round
    if staleness > job.max_staleness:
        return DeltaVerdict(
            DeltaVerdictCode.LATE,
            f"round {round} of job {name} is {staleness} rounds behind round {version}; the "
            f"job merges late deltas up to {job.max_staleness} behind",
        )
    past = job.past.get(round)
    if past is None or past.phase is not RoundPhase.PUBLISHED:
        return DeltaVerdict(
            DeltaVerdictCode.LATE,
            f"round {round} of job {name} has no published record at hand to merge against",
        )
    if region not in past.config.participants:
        return DeltaVerdict(
            DeltaVerdictCode.NOT_PARTICIPANT,
            f"{region!r} was not a participant of round {round} of job {name}",
        )
    if region in past.included:
        return DeltaVerdict(
            DeltaVerdictCode.DUPLICATE,
            f"{region}'s delta for round {round} of job {name} was taken in its own round",
        )
    if past.config.base_hash is None:
        return DeltaVerdict(
            DeltaVerdictCode.LATE,
            f"round {round} of job {name} was recorded without θ's hash, so a late delta "
            "cannot be checked against it",
        )
    if (
        current is None
        or current.config.round != version
        or current.phase is not (RoundPhase.COLLECTING)
    ):
        return DeltaVerdict(
            DeltaVerdictCode.NOT_YET,
            f"round {version} of job {name} is not collecting; {region}'s delta for round "
            f"{round} merges into the next round that does: send it again then",
        )
    for arrival in current.merged:
        if (arrival.region, arrival.round) == (region, round):
            return DeltaVerdict(
                DeltaVerdictCode.DUPLICATE,
                f"{region}'s delta for round {round} of job {name} was already merged into "
                f"round {version} {_since_open(current.config, arrival.at)}",
            )
    return DeltaVerdict(
        DeltaVerdictCode.MERGED,
        f"{region}'s delta for round {round} of job {name} merged into round {version}, "
        f"{staleness} round(s) late (weight x {staleness_factor(staleness):.3g})",
    )


def _since_open(config: RoundConfig, at: float) -> str:
    return f"at +{at - config.opened_at:.3f} s"
