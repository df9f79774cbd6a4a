"""Which round the agent runs next, and when a running round must stop. Pure, no I/O.

:class:`Schedule` keeps the latest announcement of every job and what the agent was told
about each job (paused, cancelled, resync) and has settled (rounds that ended for this
region, whatever the outcome). The agent feeds it every announcement and command it
receives, and asks :meth:`Schedule.next_round` what to do; each decision comes with the
reason it was taken, for the logs.

:func:`judge_rollback` tells a coordinator restored from an older backup from a stale
announcement, from what the region's durable state records (:class:`Progress`) and what
the coordinator says it holds now; :func:`judge_lost_delta` tells one that lost the delta
the region delivered from a round merely announced again.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from geofed.control import Command, RoundAnnouncement
from regional_agent.state import ParamsVersion

# Announcements after which an upload under way is left to end on its own.
_UPLOAD_ENDS_ON_ITS_OWN = frozenset({"closed", "open", "done"})


@dataclass(frozen=True, slots=True)
class Stop:
    """The running round of ``job`` must stop, because of ``reason``."""

    job: str
    reason: str


@dataclass(frozen=True, slots=True)
class Running:
    """The round the agent is working on, and whether its delta is already being sent."""

    job: str
    round: int
    uploading: bool = False


def merges_late(announcement: RoundAnnouncement, round: int) -> bool:
    """Whether the coordinator announcing ``announcement`` would still merge a delta of
    the earlier (or same, closed) ``round``: within the job's ``max_staleness`` of the
    round that would take it, the one open now or the next after a closed one."""
    if announcement.state not in ("open", "closed"):
        return False
    into = announcement.round + (1 if announcement.state == "closed" else 0)
    return 0 < into - round <= announcement.max_staleness


class Schedule:
    """The agent's view of every job it follows (see the module docstring)."""

    def __init__(self, region: str) -> None:
        self.region = region
        self._latest: dict[str, RoundAnnouncement] = {}
        # job -> (round, deadline): rounds before ``round`` are over; ``round`` itself is
        # over for good when deadline is None, else only as announced with that deadline.
        self._settled: dict[str, tuple[int, datetime | None]] = {}
        self._paused: set[str] = set()
        self._cancelled: set[str] = set()
        self._resync: set[str] = set()
        self.draining = False

    def latest(self, job: str) -> RoundAnnouncement | None:
        return self._latest.get(job)

    def offer(self, announcement: RoundAnnouncement, running: Running | None) -> Stop | None:
        """Take an announcement; say whether the running round must stop.

        An announcement older than the one kept (an earlier round, or the same round
        sent earlier) is ignored. A newer one for the running job stops the running round
        when that round is no longer open, unless the round's delta is being uploaded and
        the round merely closed or moved on (a later round opened, the job is done): the
        upload then ends on its own, accepted or answered ``round_closed``, and the round
        reports its outcome. A delta accepted the moment before the coordinator publishes
        the next round is thus reported, not lost to a cancellation. Nor does it stop
        when the job merges late deltas and the round's delta would still be merged
        (:func:`merges_late`): the region's work then reaches θ a round or more later
        instead of being thrown away. A pause, a cancel or an earlier round (a coordinator
        restored from a backup) still stops it: the round must not settle after the
        rollback forgot it.

        An earlier round sent *later* than the one kept is taken: a coordinator never
        announces an earlier round after a later one, unless it was restored from an
        older backup. A stale copy (a retained message replayed on reconnect, a broker
        restored from old persistence) was sent before, so it is still ignored. The
        rounds settled after it are forgotten; the pipeline confirms the rollback with
        the coordinator (:func:`judge_rollback`) before it discards anything.
        """
        job = announcement.job
        known = self._latest.get(job)
        if known is not None and (announcement.round, announcement.sent_at) < (
            known.round,
            known.sent_at,
        ):
            if announcement.sent_at <= known.sent_at:
                return None
            settled = self._settled.get(job)
            if settled is not None and settled[0] >= announcement.round:
                del self._settled[job]
        self._latest[job] = announcement
        if running is None or running.job != job:
            return None
        if announcement.round == running.round and announcement.state == "open":
            return None
        moved_on = announcement.round >= running.round
        if running.uploading and moved_on and announcement.state in _UPLOAD_ENDS_ON_ITS_OWN:
            return None
        if moved_on and merges_late(announcement, running.round):
            return None
        return Stop(job, f"round {announcement.round} is {announcement.state}")

    def command(self, command: Command, running: Running | None) -> Stop | None:
        """Apply an operator's command; say whether the running round must stop."""
        job = command.job
        if command.action == "drain":
            self.draining = True
            return None
        if job is None or command.action == "checkpoint":
            return None  # a checkpoint ask leaves the round running (the agent records it)
        if command.action == "resume":
            self._paused.discard(job)
            return None
        if command.action == "pause":
            self._paused.add(job)
        elif command.action == "cancel":
            self._cancelled.add(job)
        elif command.action == "resync":
            self._resync.add(job)
            self._settled.pop(job, None)  # a round that failed may be tried again
        if running is not None and running.job == job:
            return Stop(job, f"{command.action} requested")
        return None

    def next_round(self) -> RoundAnnouncement | None:
        """The open round to run now, if any (jobs in name order)."""
        if self.draining:
            return None
        for job in sorted(self._latest):
            announcement = self._latest[job]
            if (
                announcement.state == "open"
                and self.region in announcement.participants
                and job not in self._paused
                and job not in self._cancelled
                and not self._is_settled(announcement)
            ):
                return announcement
        return None

    def participating(self) -> bool:
        """Whether a job this region takes part in is under way (a round open or closing).

        Time under way is the wall time of the compute utilisation metric: training,
        and the waits for uploads, aggregation and the next announcement between rounds.
        """
        return any(
            announcement.state in ("open", "closed")
            and self.region in announcement.participants
            and job not in self._paused
            and job not in self._cancelled
            for job, announcement in self._latest.items()
        )

    def settle(self, job: str, round_: int, *, deadline: datetime | None = None) -> None:
        """Round ``round_`` of ``job`` ended for this region.

        With ``deadline`` None (its delta was accepted) the round is over for good.
        Otherwise (a straggler, a refusal, a failure) only its announcement with that
        deadline is: the coordinator may re-open the same round with a new deadline (after
        a pause, or below quorum), and then the region takes part again.
        """
        known = self._settled.get(job)
        if (
            known is None
            or round_ > known[0]
            or (round_ == known[0] and deadline is None)
            or (round_ == known[0] and known[1] is not None)
        ):
            self._settled[job] = (round_, deadline)

    def _is_settled(self, announcement: RoundAnnouncement) -> bool:
        known = self._settled.get(announcement.job)
        if known is None:
            return False
        round_, deadline = known
        if announcement.round != round_:
            return announcement.round < round_
        return deadline is None or announcement.deadline == deadline

    def take_resync(self, job: str) -> bool:
        """Whether ``job`` must resync before its next round (asked once)."""
        wanted = job in self._resync
        self._resync.discard(job)
        return wanted

    def request_resync(self, job: str) -> None:
        self._resync.add(job)

    def ended(self, job: str) -> bool:
        """Whether ``job`` is over for this region (done or cancelled, as last announced
        or commanded): nothing the region keeps for it outlives it."""
        latest = self._latest.get(job)
        return job in self._cancelled or (
            latest is not None and latest.state in ("done", "cancelled")
        )

    def paused(self, job: str) -> bool:
        return job in self._paused or (
            (latest := self._latest.get(job)) is not None and latest.state == "paused"
        )


@dataclass(frozen=True, slots=True)
class Progress:
    """How far the region got in a job, as its durable state records it."""

    params: ParamsVersion | None
    """The θ held."""
    uploaded_round: int | None
    """The last round whose delta the coordinator accepted."""

    @property
    def reached(self) -> int | None:
        """The latest θ version the coordinator is known to have reached."""
        rounds: list[int] = []
        if self.params is not None:
            rounds.append(self.params.round)
        if self.uploaded_round is not None:
            rounds.append(self.uploaded_round)
        return max(rounds, default=None)

    def contradicted_by(self, announcement: RoundAnnouncement) -> bool:
        """Whether ``announcement`` cannot follow this progress in one history.

        It does not when the region is past its base (it holds a later θ, or delivered a
        later round), or when the region delivered this very round from a θ of the same
        version with another hash (θ_r has one hash per history). A round announced again
        with the base the region holds (re-opened below quorum) is no contradiction.
        """
        reached = self.reached
        if reached is None:
            return False
        if reached > announcement.base_round:
            return True
        return (
            self.params is not None
            and self.params.round == announcement.base_round
            and self.params.hash != announcement.base_hash
            and self.uploaded_round is not None
            and self.uploaded_round >= announcement.round
        )

    def delivered(self, announcement: RoundAnnouncement, region: str) -> bool:
        """Whether the region delivered the very round ``announcement`` opens to it."""
        return (
            announcement.state == "open"
            and region in announcement.participants
            and self.uploaded_round == announcement.round
        )


@dataclass(frozen=True, slots=True)
class Rollback:
    """The coordinator of ``job`` went back from θ version ``from_round`` to ``to_round``."""

    job: str
    from_round: int
    to_round: int


def judge_rollback(
    announcement: RoundAnnouncement, progress: Progress, coordinator: ParamsVersion | None
) -> Rollback | None:
    """Whether ``announcement`` comes from a coordinator restored from an older backup.

    Messages carry no epoch, so the coordinator is asked (``coordinator``: the θ version
    it holds now). A rollback needs both: the announcement contradicts the region's
    progress, and the coordinator itself holds exactly the announced base. A stale
    announcement (replayed, redelivered, left retained by a restored broker) fails the
    second test: the coordinator has moved past it, so the region keeps its state, and
    the current announcement follows.
    """
    if coordinator is None or not progress.contradicted_by(announcement):
        return None
    if coordinator != ParamsVersion(announcement.base_round, announcement.base_hash):
        return None
    reached = progress.reached
    assert reached is not None  # a contradiction needs progress
    return Rollback(announcement.job, reached, announcement.base_round)


def judge_lost_delta(
    announcement: RoundAnnouncement,
    progress: Progress,
    region: str,
    coordinator: ParamsVersion | None,
    delivered: Collection[str] | None,
) -> Rollback | None:
    """Whether the coordinator was restored from a backup older than the region's delta.

    A restored coordinator that holds every delta of its round publishes the same θ
    again (aggregation is deterministic) and opens the next round, which the region may
    have delivered already: nothing in the announcement contradicts the region's
    progress, but the coordinator (``coordinator``: the θ version it holds now;
    ``delivered``: the regions whose delta of its current round it holds, None when that
    is another round) no longer has the delta. The region goes back to the announced
    base and delivers the round again. An announcement the coordinator has moved past,
    or a round it still holds the region's delta of, is no such case.
    """
    if not progress.delivered(announcement, region) or delivered is None:
        return None
    if coordinator != ParamsVersion(announcement.base_round, announcement.base_hash):
        return None
    if region in delivered:
        return None
    return Rollback(announcement.job, announcement.round, announcement.base_round)
