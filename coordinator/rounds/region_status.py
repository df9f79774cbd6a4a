"""Which status of a region the coordinator holds, and why.

A region's agent publishes its status, retained, on ``regions/<region>/status``; the
broker publishes the agent's Last Will there when its connection dies. The Will was
registered when that connection began, so its ``sent_at`` is older than every status the
connection sent since: ordered by ``sent_at`` alone it would never win, and a crashed
region would look up for ever. Yet the broker publishes a Will only once the connection is
gone, so it is the last word of everything before it. Hence:

* an ``offline`` status (a Will, or an agent's goodbye) is taken whatever its ``sent_at``;
* a live status is taken unless it is an earlier one of the same run of the agent than a
  status already taken (a late delivery): each run numbers its statuses (``boot``,
  ``seq``), so the order never rests on the sender's clock, and a host whose clock is far
  ahead cannot pin its region for ever; a restarted agent is a new run, whose statuses
  replace the Will;
* a status without a run and number (an agent that predates them) is ordered by
  ``sent_at`` as before: taken unless older than a status already taken.

Repeats (the same ``message_id``) are dropped before this, by the caller's deduplicator.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from geofed.control import RegionStatus

__all__ = ["RegionView", "take_status"]

#: How many replaced runs of an agent are remembered, to drop their late statuses.
_RETIRED = 4


@dataclass(frozen=True, slots=True)
class RegionView:
    """The status a region's agent published last, and the newest ``sent_at`` taken."""

    status: RegionStatus
    newest_sent_at: datetime
    #: The run and number of the newest live status taken (kept through a Will).
    boot: str | None = None
    seq: int = 0
    #: Runs a later run replaced: their statuses still in flight are late.
    retired: tuple[str, ...] = ()

    @property
    def up(self) -> bool:
        return self.status.state != "offline"


def take_status(held: RegionView | None, status: RegionStatus) -> tuple[RegionView | None, str]:
    """The view once ``status`` arrives (None: keep ``held``), and the reason."""
    numbered = status.boot is not None and status.seq is not None
    run = (status.boot, status.seq or 0) if numbered else (None, 0)
    if held is None:
        return RegionView(status, status.sent_at, *run), "the first status of the region"
    newest = max(held.newest_sent_at, status.sent_at)
    if status.state == "offline":
        view = RegionView(status, newest, held.boot, held.seq, held.retired)
        return view, "offline: the connection it came from is gone"
    if numbered:
        if status.boot in held.retired:
            return None, "a status of an earlier run of the agent: delivered late"
        if status.boot == held.boot:
            if (status.seq or 0) <= held.seq:
                return None, "an earlier status of the same agent run: delivered late"
            return RegionView(status, newest, *run, held.retired), "the run's next status"
        retired = held.retired if held.boot is None else (*held.retired, held.boot)[-_RETIRED:]
        return RegionView(status, newest, *run, retired), "a new run of the agent"
    if status.sent_at < held.newest_sent_at:
        return None, "older than a status already taken: delivered late"
    return RegionView(status, newest), "newer than every status taken"
