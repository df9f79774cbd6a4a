"""How the job manager schedules a job, as the job's status shows it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["JobScheduling"]


@dataclass(slots=True)
class JobScheduling:
    """How the job manager schedules the job, as its status shows it: its ``priority``
    class and ``team``, and ``queue``, its place while it waits (None otherwise), which
    the manager's admission passes keep current."""

    priority: str
    team: str
    queue: dict[str, Any] | None = None

    def status(self) -> dict[str, Any]:
        return {"priority": self.priority, "team": self.team, "queue": self.queue}
