"""Which round the agent runs next, and when a running round must stop. Pure, no I/O.

:class:`Schedule` keeps the latest announcement of every job and what the agent was told
about each job (paused, cancelled, resync) and has settled (rounds that ended for this
region, whatever the outcome). The agent feeds it every announcement and command it
receives, and asks :meth:`Schedule.next_round` what to do; each decision comes with the
reason it was taken, for the logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from geofed.control import Command, RoundAnnouncement


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
        when that round is no longer open, unless the round merely closed while its delta
        is being uploaded: the upload then ends on its own (accepted, or a straggler).
        """
        job = announcement.job
        known = self._latest.get(job)
        if known is not None and (announcement.round, announcement.sent_at) < (
            known.round,
            known.sent_at,
        ):
            return None
        self._latest[job] = announcement
        if running is None or running.job != job:
            return None
        if announcement.round == running.round and announcement.state == "open":
            return None
        closing = announcement.state == "closed" and announcement.round == running.round
        if closing and running.uploading:
            return None
        return Stop(job, f"round {announcement.round} is {announcement.state}")

    def command(self, command: Command, running: Running | None) -> Stop | None:
        """Apply an operator's command; say whether the running round must stop."""
        job = command.job
        if command.action == "drain":
            self.draining = True
            return None
        if job is None:
            return None
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

    def paused(self, job: str) -> bool:
        return job in self._paused or (
            (latest := self._latest.get(job)) is not None and latest.state == "paused"
        )
