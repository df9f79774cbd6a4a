"""The coordinator's state-store transactions: one per state change, all or nothing.

Each function takes the blocking store first, runs in the store thread (through
:meth:`coordinator.state.async_store.AsyncStore.run`) and commits its writes together with the
audit entry that records them, so the audit log and the state never disagree:

- :func:`record_admitted_job`: the admitted job, its checkpoint location, the admission;
- :func:`record_job_change`: an operator's pause, resume or cancel, only from the state seen;
- :func:`open_upload`: a region's upload now follows this manifest (another one's frames go);
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

from coordinator.rounds.records import JobState
from coordinator.state.audit import AuditEvent, AuditVerdict
from coordinator.state.store import Receipt, Store
from geofed.types import Identity

__all__ = [
    "LOCATION_POINTER",
    "DeltaOffer",
    "accept_delta",
    "open_upload",
    "record_admitted_job",
    "record_initial",
    "record_job_change",
    "record_job_failure",
    "record_publication",
    "upload_pointer",
]

#: Pointer naming the storage location a job's checkpoints go to (chosen at admission).
LOCATION_POINTER = "checkpoint_location"


def upload_pointer(round: int, region: str) -> str:
    """Pointer naming the open (uncommitted) upload of a region for a round."""
    return f"upload.{round}.{region}"


def record_admitted_job(
    store: Store,
    job: str,
    spec: Mapping[str, Any],
    location: str,
    actor: Identity,
    decisions: int,
    *,
    queued: bool = False,
) -> None:
    """Create the admitted job with its checkpoint location; audit the admission.

    The job is running, or ``queued`` for capacity (its audit details say so).
    :class:`~coordinator.state.store.AlreadyExists` if the job id is taken.
    """
    details: dict[str, Any] = {"checkpoint_location": location, "decisions": decisions}
    if queued:
        details["queued"] = True
    with store.transaction():
        store.create_job(job, spec, (JobState.QUEUED if queued else JobState.RUNNING).value)
        store.set_pointer(job, LOCATION_POINTER, location)
        store.append_audit(
            AuditEvent(
                actor=actor,
                action="job.admit",
                verdict=AuditVerdict.ALLOW,
                job=job,
                details=details,
            )
        )


def record_job_change(
    store: Store,
    job: str,
    action: str,
    current: JobState,
    target: JobState,
    actor: Identity,
    *,
    round: int | None = None,
    details: Mapping[str, Any] | None = None,
) -> None:
    """``action`` moves the job from ``current`` to ``target``; ConflictError if it moved.

    ``details`` are audited besides the move (a reason, say).
    """
    with store.transaction():
        store.set_job_state(job, target.value, expected=current.value)
        store.append_audit(
            AuditEvent(
                actor=actor,
                action=f"job.{action}",
                verdict=AuditVerdict.OK,
                job=job,
                round=round,
                details={"from": current.value, "to": target.value, **(details or {})},
            )
        )


def open_upload(
    store: Store, job: str, round: int, region: str, manifest_digest: str, *, fresh: bool = False
) -> dict[int, str]:
    """Point the region's open upload at this manifest; return its frames received so far.

    An upload of another manifest for the same round is forgotten (its frames with it);
    the same manifest again resumes where it stopped, unless ``fresh``: the spool holds
    none of its frames (its stream file was made anew), so the rows of frames recorded
    before are forgotten too.
    """
    pointer = upload_pointer(round, region)
    with store.transaction():
        previous = store.get_pointer(job, pointer)
        if previous and previous != manifest_digest:
            store.clear_upload(job, round, region, previous)
        if fresh:
            store.clear_upload(job, round, region, manifest_digest)
        store.set_pointer(job, pointer, manifest_digest)
    return store.uploaded_chunks(job, round, region, manifest_digest)


#: The seconds a region may report of its round with its delta's commit.
ROUND_TIMINGS = ("train_s", "encode_s", "upload_s")


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
    #: The region's held-out metrics of the round's base parameters, from its manifest.
    base_eval: Mapping[str, float] | None = None
    #: What the region reported of its round with the commit (:data:`ROUND_TIMINGS`).
    timings: Mapping[str, float] | None = None
    #: The region's fingerprint of each dataset it trained on, from its manifest.
    data_fingerprints: Mapping[str, str] | None = None


def accept_delta(
    store: Store,
    job: str,
    offer: DeltaOffer,
    record: Mapping[str, Any],
    reason: str,
    into: int | None = None,
) -> Receipt:
    """Record the receipt and the round that now counts it; close the upload.

    ``into`` is the round whose ``record`` it is: a late delta's receipt names its own
    round and the record that of the later round merging it (None: the delta's round).
    """
    into = offer.round if into is None else into
    merged = {"merged_into": into, "staleness": into - offer.round} if into != offer.round else {}
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
        store.save_round(job, into, record)
        store.clear_upload(job, offer.round, offer.region)
        store.set_pointer(job, upload_pointer(offer.round, offer.region), "")
        store.append_audit(
            AuditEvent(
                actor=offer.actor,
                action="delta.accept",
                verdict=AuditVerdict.ALLOW,
                job=job,
                round=offer.round,
                region=offer.region,
                details={
                    "manifest": offer.manifest_digest,
                    "stream": offer.blob_digest,
                    "size": offer.size,
                    "tokens": offer.tokens,
                    # The region's reported training loss and seconds trained, encoded
                    # and uploaded: the status page's curves and timeline.
                    "train_loss": offer.train_loss,
                    **({"timings": dict(offer.timings)} if offer.timings else {}),
                    **(
                        {"data_fingerprints": dict(offer.data_fingerprints)}
                        if offer.data_fingerprints
                        else {}
                    ),
                    "reason": reason,
                    **merged,
                },
            )
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
            AuditEvent(
                actor=actor,
                action="checkpoint.snapshot",
                verdict=AuditVerdict.OK,
                job=job,
                round=0,
                details=details,
            )
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
            AuditEvent(
                actor=actor,
                action="round.publish",
                verdict=AuditVerdict.OK,
                job=job,
                round=round,
                details=details,
            )
        )


def record_job_failure(store: Store, job: str, actor: Identity, reason: str) -> None:
    with store.transaction():
        store.set_job_state(job, JobState.FAILED.value)
        store.append_audit(
            AuditEvent(
                actor=actor,
                action="job.fail",
                verdict=AuditVerdict.ERROR,
                job=job,
                details={"reason": reason},
            )
        )
