"""The job as ``GET /v1/jobs/{job}`` shows it: a pure rendering of its engine's facts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from coordinator.jobs.spec import JobSpec
from coordinator.rounds.records import JobState, RoundRecord
from coordinator.scheduling.elastic import Membership
from coordinator.state.store import DeltaTotals

__all__ = ["deltas_json", "job_status", "shards_status"]


def job_status(
    *,
    job: str,
    state: JobState,
    version: int,
    rounds: int,
    regions: Mapping[str, Sequence[str]],
    params_hash: str | None,
    location: str,
    val_loss: tuple[int, float] | None,
    val_history: Mapping[int, float],
    error: str,
    quarantined: Mapping[str, str],
    record: RoundRecord | None,
    evaluation: tuple[int, Mapping[str, float]] | None = None,
) -> dict[str, Any]:
    """The status JSON of a job at round ``version`` of ``rounds``.

    ``regions`` maps each region to its datasets, ``val_loss`` is the newest evaluated
    (round, loss), ``evaluation`` the newest evaluated round's every metric,
    ``quarantined`` the regions held back now with why, and ``record`` the current
    round's record; an empty ``error`` is shown as null.
    """
    body: dict[str, Any] = {
        "job": job,
        "state": state.value,
        "round": version,
        "rounds": rounds,
        "params_hash": params_hash,
        "checkpoint_location": location,
        "regions": {region: list(datasets) for region, datasets in regions.items()},
        "global_val_loss": None,
        "error": error or None,
    }
    if val_loss is not None:
        body["global_val_loss"] = {"round": val_loss[0], "value": val_loss[1]}
    body["evaluation"] = (
        None
        if evaluation is None
        else {"round": evaluation[0], "metrics": dict(sorted(evaluation[1].items()))}
    )
    body["val_loss_history"] = [
        {"round": number, "value": value} for number, value in sorted(val_history.items())
    ]
    body["quarantined"] = dict(quarantined)
    if record is not None:
        rs = record.state
        body["current"] = {
            "round": rs.config.round,
            "phase": rs.phase.value,
            "attempt": record.attempt,
            "participants": list(rs.config.participants),
            "delivered": list(rs.delivered),
            # Late deltas of earlier rounds taken into this one (aggregation.late: merge).
            "merged": [{"region": a.region, "round": a.round} for a in rs.merged],
            "min_regions": rs.config.min_regions,
            "grace_s": rs.config.grace_s,
            "deadline": datetime.fromtimestamp(rs.deadline_at, UTC).isoformat(),
            "deadline_reason": record.deadline_reason,
            "end_reason": rs.end_reason or None,
            # The data shard slots the round opened with (None: recorded before slots were).
            "shards": dict(rs.config.shards) if rs.config.shards is not None else None,
        }
    return body


def shards_status(spec: JobSpec, applied: Membership, membership: Membership) -> dict[str, Any]:
    """The job's data shard slots: who holds which now (``applied``), and from the next
    round (``membership``)."""
    return {
        "count": applied.slots,
        "min_regions": spec.quorum,
        "max_regions": spec.region_slots,
        "assignment": dict(applied.assignment),
        "next": dict(membership.assignment),
        "left": list(membership.departed),
    }


def deltas_json(totals: Mapping[str, DeltaTotals]) -> dict[str, Any]:
    """The job's accepted deltas as its status shows them (``deltas``): from the durable
    receipts, so a coordinator restart loses none of them; per region and in all."""
    return {
        "accepted": sum(t.deltas for t in totals.values()),
        "bytes": sum(t.bytes for t in totals.values()),
        "tokens": sum(t.tokens for t in totals.values()),
        "regions": {
            region: {"accepted": t.deltas, "bytes": t.bytes, "tokens": t.tokens}
            for region, t in sorted(totals.items())
        },
    }
