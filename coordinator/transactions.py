"""The state-store transactions of the round driver: one per state change, all or nothing.

Each function runs in the store thread and commits its writes together with the audit
entry that records them, so the audit log and the state never disagree:

- :func:`accept_delta`: the receipt, the round state that counts it, the end of the upload;
- :func:`record_initial`: the pointers to θ_0's working state, with the snapshot audited;
- :func:`record_publication`: round r published *and* the pointers moved to θ_{r+1}, so a
  round is applied exactly once (a crash before it commits makes the engine recompute);
- :func:`record_job_failure`: the job failed, and why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.audit import Verdict
from coordinator.records import JobState
from coordinator.store import Receipt, Store
from geofed.types import Identity

__all__ = [
    "DeltaOffer",
    "accept_delta",
    "record_initial",
    "record_job_failure",
    "record_publication",
    "upload_pointer",
]


def upload_pointer(round: int, region: str) -> str:
    """Pointer naming the open (uncommitted) upload of a region for a round."""
    return f"upload.{round}.{region}"


@dataclass(frozen=True, slots=True)
class DeltaOffer:
    """A verified delta whose stream is durable, offered to the round it was made for."""

    region: str
    round: int
    manifest_digest: str
    blob_digest: str
    size: int
    tokens: int
    train_loss: float | None
    actor: Identity


def accept_delta(
    store: Store, job: str, offer: DeltaOffer, record: Mapping[str, Any], reason: str
) -> Receipt:
    """Record the receipt and the round that now counts it; close the upload."""
    with store.transaction():
        receipt = store.record_receipt(
            job,
            offer.round,
            offer.region,
            offer.manifest_digest,
            offer.blob_digest,
            offer.size,
            offer.tokens,
        )
        store.save_round(job, offer.round, record)
        store.clear_upload(job, offer.round, offer.region)
        store.set_pointer(job, upload_pointer(offer.round, offer.region), "")
        store.append_audit(
            actor=offer.actor,
            action="delta.accept",
            verdict=Verdict.ALLOW,
            job=job,
            round=offer.round,
            region=offer.region,
            details={
                "manifest": offer.manifest_digest,
                "stream": offer.blob_digest,
                "size": offer.size,
                "tokens": offer.tokens,
                "reason": reason,
            },
        )
    return receipt


def record_initial(
    store: Store,
    job: str,
    pointers: Mapping[str, str],
    actor: Identity,
    details: Mapping[str, Any],
) -> None:
    """θ_0 exists: point the job at it and audit its snapshot."""
    with store.transaction():
        for name, value in pointers.items():
            store.set_pointer(job, name, value)
        store.append_audit(
            actor=actor,
            action="checkpoint.snapshot",
            verdict=Verdict.OK,
            job=job,
            round=0,
            details=details,
        )


def record_publication(
    store: Store,
    job: str,
    round: int,
    record: Mapping[str, Any],
    pointers: Mapping[str, str],
    *,
    completed: bool,
    actor: Identity,
    details: Mapping[str, Any],
) -> None:
    """Round ``round`` is published: its record, θ_{round+1}'s pointers, maybe the job's end."""
    with store.transaction():
        store.save_round(job, round, record)
        for name, value in pointers.items():
            store.set_pointer(job, name, value)
        if completed:
            store.set_job_state(job, JobState.COMPLETED.value)
        store.append_audit(
            actor=actor,
            action="round.publish",
            verdict=Verdict.OK,
            job=job,
            round=round,
            details=details,
        )


def record_job_failure(store: Store, job: str, actor: Identity, reason: str) -> None:
    with store.transaction():
        store.set_job_state(job, JobState.FAILED.value)
        store.append_audit(
            actor=actor,
            action="job.fail",
            verdict=Verdict.ERROR,
            job=job,
            details={"reason": reason},
        )
