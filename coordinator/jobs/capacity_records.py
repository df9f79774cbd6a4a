"""State-store transactions of capacity admission, each with the audit entry it records.

- :func:`record_queued_job`: a job residency admitted, waiting for capacity (``queued``);
- :func:`record_job_start`: a queued job starts, with the regions and the reason;
- :func:`record_preemption_pending`: a running job is to stop at its next round boundary
  (kept in the ``preempting`` pointer, so a restarted coordinator still stops it there);
- :func:`record_job_preempted`: a running job went back to the queue at a round boundary.

Both are ``job.admit`` entries: the first (verdict ``allow``) as for a job that starts
at once (:func:`coordinator.state.transactions.record_admitted_job`) with ``"queued": true``;
the second (verdict ``ok``) moves the job from ``queued`` to ``running``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from coordinator.rounds.records import JobState
from coordinator.state.store import Store
from coordinator.state.transactions import record_admitted_job, record_job_change
from geofed.types import Identity

__all__ = [
    "PREEMPTING_POINTER",
    "record_job_preempted",
    "record_job_start",
    "record_preemption_pending",
    "record_queued_job",
]

#: Why a running job stops at its next round boundary ("" once it did, or never).
PREEMPTING_POINTER = "preempting"


def record_queued_job(
    store: Store,
    job: str,
    spec: Mapping[str, Any],
    location: str,
    actor: Identity,
    decisions: int,
) -> None:
    """Create the admitted job, queued, with its checkpoint location; audit the admission.

    :class:`~coordinator.state.store.AlreadyExists` if the job id is taken.
    """
    record_admitted_job(store, job, spec, location, actor, decisions, queued=True)


def record_job_start(
    store: Store, job: str, actor: Identity, reason: str, regions: Sequence[str]
) -> None:
    """The queued ``job`` starts; ConflictError if it is not queued any more."""
    details = {"reason": reason, "regions": list(regions)}
    record_job_change(
        store, job, "admit", JobState.QUEUED, JobState.RUNNING, actor, details=details
    )


def record_preemption_pending(store: Store, job: str, reason: str) -> None:
    """``job`` is to stop at its next round boundary for ``reason``."""
    store.set_pointer(job, PREEMPTING_POINTER, reason)


def record_job_preempted(store: Store, job: str, actor: Identity, reason: str, round: int) -> None:
    """``job`` stopped before ``round`` for another job; ConflictError if it is not running."""
    with store.transaction():
        record_job_change(
            store,
            job,
            "preempt",
            JobState.RUNNING,
            JobState.QUEUED,
            actor,
            round=round,
            details={"reason": reason},
        )
        store.set_pointer(job, PREEMPTING_POINTER, "")
