"""The coordinator records each round a region's agent refused itself once, with the
region as actor, however often the region's status repeats it."""

from __future__ import annotations

from typing import Any, cast

from coordinator.rounds.region_refusals import RegionRefusals
from coordinator.state.audit import AuditEvent, AuditVerdict
from geofed.control import RegionStatus


class Audit:
    """Stands in for the state store's audit log: keeps what is appended."""

    def __init__(self) -> None:
        self.events: list[AuditEvent] = []

    async def append_audit(self, event: AuditEvent) -> None:
        self.events.append(event)


def status(round_: int, refused: bool = True, detail: str = "no such dataset") -> RegionStatus:
    return RegionStatus(
        region="eu-west",
        state="error",
        job="llm",
        round=round_,
        agent_version="geofed-agent/test",
        detail=detail,
        refused=refused,
    )


async def test_each_refusal_is_recorded_once() -> None:
    audit = Audit()
    record = RegionRefusals(cast(Any, audit), "acme")
    for each in (status(0), status(0), status(0, refused=False), status(1), status(1, detail="x")):
        await record("eu-west", each)
    assert [(e.round, dict(e.details or {}).get("reason")) for e in audit.events] == [
        (0, "no such dataset"),
        (1, "no such dataset"),
        (1, "x"),
    ]
    first = audit.events[0]
    assert (first.action, first.verdict, first.job, first.region) == (
        "round.refuse",
        AuditVerdict.DENY,
        "llm",
        "eu-west",
    )
    assert str(first.actor) == "spiffe://acme/region/eu-west"
