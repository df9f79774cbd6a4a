"""Which status of a region the coordinator holds, and why.

A region's agent publishes its status, retained, on ``regions/<region>/status``; the
broker publishes the agent's Last Will there when its connection dies. The Will was
registered when that connection began, so its ``sent_at`` is older than every status the
connection sent since: ordered by ``sent_at`` alone it would never win, and a crashed
region would look up for ever. Yet the broker publishes a Will only once the connection is
gone, so it is the last word of everything before it. Hence:

* an ``offline`` status (a Will, or an agent's goodbye) is taken whatever its ``sent_at``;
* a live status is taken unless it is older than a status already taken (a late
  delivery): a restarted or reconnected agent's statuses are newer than everything its
  previous connection sent, so they replace the Will.

Repeats (the same ``message_id``) are dropped before this, by the caller's deduplicator.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from geofed.control import RegionStatus

__all__ = ["RegionView", "take_status"]


@dataclass(frozen=True, slots=True)
class RegionView:
    """The status a region's agent published last, and the newest ``sent_at`` taken."""

    status: RegionStatus
    newest_sent_at: datetime

    @property
    def up(self) -> bool:
        return self.status.state != "offline"


def take_status(held: RegionView | None, status: RegionStatus) -> tuple[RegionView | None, str]:
    """The view once ``status`` arrives (None: keep ``held``), and the reason."""
    if held is None:
        return RegionView(status, status.sent_at), "the first status of the region"
    newest = max(held.newest_sent_at, status.sent_at)
    if status.state == "offline":
        return RegionView(status, newest), "offline: the connection it came from is gone"
    if status.sent_at < held.newest_sent_at:
        return None, "older than a status already taken: delivered late"
    return RegionView(status, newest), "newer than every status taken"
