"""Rounds a region's own agent refused, in the coordinator's audit log.

An agent refuses a round itself when its residency policy forbids the training or the
upload, or when the job names a dataset it does not train on. It says so in its status
(``refused``, with the reason in ``detail``); :class:`RegionRefusals` appends one
``round.refuse`` audit entry per region, job, round and reason (statuses repeat every
heartbeat), with the region as the actor.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Final

from coordinator.state.async_store import AsyncStore
from coordinator.state.audit import AuditEvent, AuditVerdict
from geofed.control import RegionStatus
from geofed.types import Identity, Role

__all__ = ["RegionRefusals"]

log = logging.getLogger(__name__)

#: How many refusals are remembered to drop their repeats (a coordinator restart forgets
#: them: a refusal still shown then is recorded once more).
_REMEMBERED: Final = 1024


class RegionRefusals:
    """Audits each refusal a region's status reports, once (see the module docstring)."""

    def __init__(self, db: AsyncStore, federation: str) -> None:
        self._db = db
        self._federation = federation
        self._seen: OrderedDict[tuple[str, str, int | None, str], None] = OrderedDict()

    async def __call__(self, region: str, status: RegionStatus) -> None:
        if not status.refused or status.job is None:
            return
        key = (region, status.job, status.round, status.detail)
        if key in self._seen:
            return
        self._seen[key] = None
        while len(self._seen) > _REMEMBERED:
            self._seen.popitem(last=False)
        log.warning(
            "region %s refused job %s round %s: %s", region, status.job, status.round, status.detail
        )
        await self._db.append_audit(
            AuditEvent(
                actor=Identity(self._federation, Role.REGION, region),
                action="round.refuse",
                verdict=AuditVerdict.DENY,
                job=status.job,
                round=status.round,
                region=region,
                details={"reason": status.detail},
            )
        )
