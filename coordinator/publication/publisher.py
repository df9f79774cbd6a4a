"""Publishing a closed round, and trying again when that fails.

The round engine decides when (:mod:`coordinator.rounds.driver`) and holds the job's state
and lock; :class:`RoundPublisher` does the work. :meth:`~RoundPublisher.compute`
aggregates the round's deltas in arrival order, takes the outer step, signs and
stores the update (:func:`coordinator.aggregation.outer_round.publish_round`, in a worker thread);
:meth:`~RoundPublisher.commit` marks the round published *and* moves the job's pointers
to θ_{r+1} in one transaction, so a round is applied exactly once and a crash before it
makes the restarted engine recompute the same round bit for bit (the deltas are summed
in the round's recorded arrival order, folded as they arrived or decoded again);
:meth:`~RoundPublisher.finish` drops what the round no longer needs and counts it.

When computing or storing fails (the checkpoint storage is full or unwritable) the round
stays closed with the same deltas: the engine rebuilds θ_r's working state from storage
(the outer step is taken in its tensors), the next try aggregates the same deltas and
reuses the artifacts a failed try stored. :func:`plan_retry` says when that try is due (an
exponential back-off, ``publication_retry`` in the coordinator config) or that the tries
are spent and the job fails. The regions' ``max_round_attempts`` is not spent on the
coordinator's storage trouble.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import JsonValue

from coordinator.aggregation.accumulator import RoundAccumulator
from coordinator.aggregation.outer_round import (
    DeltaSource,
    PublishedRound,
    delta_sources,
    publish_round,
)
from coordinator.config import PublicationRetryConfig
from coordinator.intake.spool import Spool
from coordinator.jobs.context import JobContext
from coordinator.jobs.recovery import merged_receipts, replayed_rounds
from coordinator.publication.lineage import ContributionLog, round_record
from coordinator.publication.snapshot_policy import decide_state_save
from coordinator.publication.snapshots import JobSnapshots
from coordinator.rounds.records import RoundRecord
from coordinator.rounds.state import RoundState
from coordinator.services import Services
from coordinator.state.audit import AuditEvent, AuditVerdict, format_time
from coordinator.state.store import Receipt
from coordinator.state.transactions import record_publication
from coordinator.storage.retention import plan_retention
from coordinator.storage.working_state import ParamsError, WorkingState, read_pointers
from geofed.blobstore import BlobStore

__all__ = [
    "ComputedRound",
    "PublicationFailed",
    "RetryPlan",
    "RoundPublisher",
    "delta_sources",
    "discard_inputs",
    "plan_retry",
    "publication_details",
]

log = logging.getLogger(__name__)


class PublicationFailed(Exception):
    """Computing or storing a round's update failed; ``cause`` says how. It may be retried."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


@dataclass(frozen=True, slots=True)
class RetryPlan:
    """What the ``failures``-th failed publication of a round leads to (see :func:`plan_retry`)."""

    round: int
    reason: str  # the last failure, "ExceptionType: message"
    failures: int
    max_attempts: int
    delay_s: float
    retry_at: float  # wall clock

    @property
    def exhausted(self) -> bool:
        """True when no try is left: the job fails."""
        return self.failures >= self.max_attempts

    def audit_details(self) -> dict[str, Any]:
        """The details of the ``round.fail`` audit entry."""
        return {
            "reason": self.reason,
            "publication_failures": self.failures,
            "max_attempts": self.max_attempts,
            "retry_in_s": None if self.exhausted else self.delay_s,
            "retry_at": None if self.exhausted else format_time(self.retry_at),
        }

    @property
    def retry_time(self) -> str:
        """When the next try is due, ISO 8601 to the second."""
        return datetime.fromtimestamp(self.retry_at, UTC).isoformat(timespec="seconds")

    @property
    def waiting(self) -> str:
        """The job's ``error`` while it waits for the next try."""
        return (
            f"publication of round {self.round} failed (attempt {self.failures} of "
            f"{self.max_attempts}): {self.reason}; retrying at {self.retry_time} "
            f"(in {self.delay_s:g} s)"
        )

    def given_up(self, location: str, root: Path, state_dir: Path) -> str:
        """Why the job failed, and what the operator does about it."""
        return (
            f"round {self.round} could not be published: all {self.failures} attempt(s) "
            f"allowed by publication_retry.max_attempts failed; last: {self.reason}. Free "
            f"space (or fix permissions) in the checkpoint location {location} ({root}) "
            f"and the state directory ({state_dir}), then submit the job again; its "
            f"checkpoints up to round {self.round} remain. To ride out longer outages, "
            f"raise publication_retry in the coordinator config."
        )


def plan_retry(
    round: int, failures: int, reason: str, retry: PublicationRetryConfig, now: float
) -> RetryPlan:
    """The next try of round ``round``'s publication after its ``failures``-th failure."""
    delay = retry.delay_s(failures)
    return RetryPlan(round, reason, failures, retry.max_attempts, delay, now + delay)


def publication_details(published: PublishedRound, rs: RoundState, location: str) -> dict[str, Any]:
    """The details of the ``round.publish`` audit entry (``norm_checks``: the deltas the
    norm check clipped or left out, each with its reason; ``order``: the order the mean
    summed the regions in; ``summation``: whether the deltas were folded on arrival or
    decoded at publication)."""
    details: dict[str, Any] = {
        "update": published.update.bundle_digest,
        "update_manifest": published.update.manifest_digest,
        "snapshot": published.snapshot.bundle_digest if published.snapshot else None,
        "params_hash": published.state.params_hash,
        "included": list(rs.included),
        "stragglers": list(rs.stragglers),
        "tokens": published.tokens,
        "location": location,
        "order": list(published.order),
        "summation": published.summation,
        # What the chain stores (and each region fetches) of this round: usage reports.
        "update_size": published.update.size,
    }
    if published.snapshot is not None:
        details["snapshot_size"] = published.snapshot.size
    if published.norm_checks:
        details["norm_checks"] = [verdict.record() for verdict in published.norm_checks]
    return details


def discard_inputs(
    spool_dir: Path, deltas: BlobStore, job: str, round: int, digests: Iterable[str]
) -> None:
    """A published round's abandoned uploads, and the deltas ``digests`` (those no saved
    working state needs to replay any more), are no longer needed (blocking)."""
    try:
        Spool(spool_dir).discard_round(job, round)
        for digest in digests:
            deltas.delete(digest)
    except OSError as exc:
        log.warning("job %s round %d: cannot discard its spooled deltas: %s", job, round, exc)


@dataclass(frozen=True, slots=True)
class ComputedRound:
    """A round's update computed and stored, not yet committed."""

    published: PublishedRound
    sources: list[DeltaSource]
    elapsed_s: float
    #: When the computation ended (the service clock): the round's ``publish`` span ends
    #: there.
    computed_at: float


class RoundPublisher:
    """The work of publishing one job's closed rounds (see the module docstring)."""

    def __init__(self, services: Services, ctx: JobContext, snapshots: JobSnapshots) -> None:
        self._s = services
        self._ctx = ctx
        self._snapshots = snapshots

    async def compute(
        self,
        record: RoundRecord,
        working: WorkingState,
        accumulator: RoundAccumulator | None = None,
    ) -> ComputedRound:
        """Aggregate, step, encode, sign and store the round; :class:`PublicationFailed`.

        The deltas are summed in the round's arrival order: taken from ``accumulator``
        when it holds exactly them, decoded from their durable streams otherwise. The
        step is taken in ``working``'s own tensors (the round's peak memory is then θ,
        the momentum, the residual and the mean): after the call, returned or raised,
        ``working`` no longer holds θ_r, and the caller takes the new state or rebuilds
        θ_r's from storage.
        """
        job, rs = self._ctx.job, record.state
        round_ = rs.config.round
        receipts = await self._s.db.list_receipts(job, round_)
        try:
            merged = await merged_receipts(self._s, job, rs)
        except ParamsError as exc:
            raise PublicationFailed(exc) from exc
        sources = delta_sources(receipts, rs.included, merged, round_)
        order = rs.summed
        folded_sum = None
        if accumulator is not None:
            weights = {source.key: source.weight for source in sources}
            folded_sum, why = accumulator.take(order, weights)
            if folded_sum is None:
                log.info("job %s round %d: decoding the deltas again: %s", job, round_, why)
        faults, state_dir = self._s.runtime.faults, self._s.config.state_dir
        await faults.reached("aggregate", state_dir, job, round_)
        lineage = await self._lineage(round_, [*receipts, *merged], rs.included)
        snapshot = self._snapshots.decide(rs)
        save = decide_state_save(
            round_ + 1,
            None if working.saved is None else working.saved.version,
            snapshot=snapshot.take,
            last=round_ + 1 >= self._ctx.spec.rounds,
            every=self._ctx.spec.working_state_every,
        )
        log.info(
            "job %s round %d: θ_%d %s: %s; working state %s: %s",
            job,
            round_,
            round_ + 1,
            "snapshotted" if snapshot.take else "not snapshotted",
            snapshot.reason,
            "saved" if save.take else "not saved",
            save.reason,
        )
        started = time.monotonic()
        try:
            published = await self._s.executors.compute(
                publish_round,
                self._ctx.publishing,
                working,
                sources,
                datetime.now(UTC),
                order=order,
                folded_sum=folded_sum,
                lineage=lineage,
                snapshot=snapshot.take,
                save_state=save.take,
                in_place=True,
            )
        except Exception as exc:
            raise PublicationFailed(exc) from exc
        elapsed = time.monotonic() - started
        if published.snapshot_s is not None:
            self._snapshots.stored(round_ + 1, published.snapshot_s)
        await faults.reached("publish", state_dir, job, round_)
        return ComputedRound(published, sources, elapsed, self._s.clock())

    async def _kept_deltas(self, old_pointers: Mapping[str, str], round_: int) -> list[str]:
        """The deltas kept for replay of the rounds from the previously saved state up to
        ``round_`` (excluded)."""
        try:
            since = read_pointers(old_pointers).saved.version
        except ParamsError:
            return []  # no state saved before (θ_0's is): nothing was kept
        rounds = await replayed_rounds(self._s, self._ctx, since, round_)
        return [digest for replayed in rounds for digest in replayed.digests]

    async def _lineage(
        self, round_: int, receipts: Sequence[Receipt], included: Sequence[str]
    ) -> dict[str, JsonValue] | None:
        """The round's lineage record for the update's manifest (None if it cannot be made:
        the round is published all the same)."""
        contributions = ContributionLog(self._s.config.state_dir / "lineage")
        try:
            return await self._s.executors.files(
                functools.partial(
                    round_record,
                    contributions,
                    job=self._ctx.job,
                    round_=round_,
                    spec=self._ctx.spec.to_json(),
                    receipts=receipts,
                    included=included,
                )
            )
        except Exception as exc:  # lineage records the round; it never stops it
            log.warning("job %s round %d: no lineage record: %s", self._ctx.job, round_, exc)
            return None

    async def commit(
        self, record: RoundRecord, published: PublishedRound, *, completed: bool
    ) -> None:
        """Record the round published and the job's new pointers in one transaction.

        ``record`` already says the round is published; the engine calls this under its
        lock, so no delta is judged against a half-published round.
        """
        details = publication_details(published, record.state, self._ctx.location_name)
        if completed:
            details["completed"] = True  # the job's end is on the record (usage reports)
        await self._s.db.run(
            record_publication,
            self._ctx.job,
            record.state.config.round,
            record.to_dict(),
            published.pointers,
            completed=completed,
            actor=self._s.actor,
            details=details,
        )

    async def finish(
        self, record: RoundRecord, computed: ComputedRound, old_pointers: Mapping[str, str]
    ) -> None:
        """After the commit: drop what the saved working state no longer needs (the older
        state, the deltas of the rounds up to it) and the round's spooled inputs, count,
        announce. A round that did not save the state keeps its deltas: a restart replays
        the round from them (:mod:`coordinator.storage.replay`)."""
        job, rs, published = self._ctx.job, record.state, computed.published
        round_ = rs.config.round
        runtime = self._s.runtime
        saved = published.state.saved
        replayable: list[str] = []
        if saved is not None and saved.version == round_ + 1:
            params_store = self._ctx.publishing.params_store
            await self._s.executors.files(params_store.delete, old_pointers, published.pointers)
            replayable = await self._kept_deltas(old_pointers, round_)
            replayable += [source.blob_digest for source in computed.sources]
        if record.publication_failures:
            log.info(
                "job %s round %d published after %d failed attempt(s)",
                job,
                round_,
                record.publication_failures,
            )
        await self._s.executors.files(
            discard_inputs, runtime.spool_dir, self._ctx.publishing.deltas, job, round_, replayable
        )
        contributions = ContributionLog(self._s.config.state_dir / "lineage")
        late = [(a.region, a.round) for a in rs.merged if a.round is not None]
        await self._s.executors.files(contributions.discard_round, job, round_, late)
        await self._snapshots.published(rs)
        self._s.runtime.traces.published(
            job,
            round_,
            closed_at=rs.closed_at or rs.ended_at or computed.computed_at,
            publish_s=computed.elapsed_s,
            published_at=computed.computed_at,
            included=len(rs.included),
        )
        if published.snapshot is not None:
            await self._retain(round_)
        metrics = self._s.metrics
        metrics.aggregation_duration.labels(job=job).observe(computed.elapsed_s)
        metrics.rounds_completed.labels(job=job).inc()
        metrics.round_duration.labels(job=job).observe(
            max(0.0, (rs.ended_at or self._s.clock()) - rs.config.opened_at)
        )
        metrics.current_round.labels(job=job).set(published.state.version)
        metrics.last_checkpoint.labels(job=job).set(time.time())
        for region in rs.stragglers:
            metrics.stragglers.labels(job=job, region=region).inc()
        log.info(
            "job %s round %d published from %s in %.2f s: θ_%d hash %s",
            job,
            round_,
            ", ".join(rs.included),
            computed.elapsed_s,
            round_ + 1,
            published.state.params_hash[:16],
        )
        for verdict in published.norm_checks:
            log.warning(
                "job %s round %d: delta of %s %s: %s",
                job,
                round_,
                verdict.region,
                verdict.action,
                verdict.reason,
            )
        await self._s.control.event(
            "round.published", job=job, round=round_, detail=published.update.bundle_digest
        )

    async def _retain(self, round_: int) -> None:
        """After a snapshot: drop what the job's ``retention`` no longer keeps; audit it."""
        config = self._ctx.spec.retention
        if config is None:
            return
        store = self._ctx.publishing.location.store
        job = self._ctx.job
        try:
            entries = await self._s.executors.files(store.entries, job)
            spec = self._ctx.spec
            spacing = spec.fixed_snapshot_every or spec.snapshot_min_rounds
            plan = plan_retention(entries, config, spacing)
            if not plan.remove:
                return
            result = await self._s.executors.files(store.remove, job, plan.remove)
        except OSError as exc:
            # Pruning only frees space: the next snapshot tries again.
            log.warning("job %s: cannot prune its checkpoint chain: %s", job, exc)
            return
        log.info("job %s: checkpoint chain pruned: %s", job, plan.reason)
        await self._s.db.append_audit(
            AuditEvent(
                actor=self._s.actor,
                action="checkpoint.prune",
                verdict=AuditVerdict.OK,
                job=job,
                round=round_,
                details={
                    "reason": plan.reason,
                    "removed": [[e.kind.value, e.round] for e in result.removed],
                    "deleted_blobs": len(result.deleted_blobs),
                    "location": self._ctx.location_name,
                },
            )
        )

    async def record_failure(
        self, record: RoundRecord, failure: PublicationFailed, now: float
    ) -> RetryPlan:
        """Count a failed publication in the round's record (under the engine's lock).

        Past the bound of attempts the round fails with it.
        """
        record.publication_failures += 1
        round_ = record.state.config.round
        plan = plan_retry(
            round_, record.publication_failures, str(failure), self._s.config.publication_retry, now
        )
        if plan.exhausted:
            record.state.fail(now, f"publication failed: {plan.reason}")
        await self._s.db.save_round(self._ctx.job, round_, record.to_dict())
        return plan

    async def report_failure(self, plan: RetryPlan, failure: PublicationFailed) -> None:
        """Count, audit and log a failed publication."""
        job = self._ctx.job
        self._s.metrics.rounds_failed.labels(job=job).inc()
        await self._s.db.append_audit(
            AuditEvent(
                actor=self._s.actor,
                action="round.fail",
                verdict=AuditVerdict.ERROR,
                job=job,
                round=plan.round,
                details=plan.audit_details(),
            )
        )
        if plan.exhausted:
            log.error(
                "job %s round %d: publication attempt %d of %d failed: %s",
                job,
                plan.round,
                plan.failures,
                plan.max_attempts,
                plan.reason,
                exc_info=failure.cause,
            )
            return
        log.warning(
            "job %s round %d: publication attempt %d of %d failed: %s; next attempt in %g s, at %s",
            job,
            plan.round,
            plan.failures,
            plan.max_attempts,
            plan.reason,
            plan.delay_s,
            plan.retry_time,
            exc_info=failure.cause,
        )

    def given_up(self, plan: RetryPlan) -> str:
        """Why the job fails once ``plan`` is exhausted."""
        root = self._ctx.publishing.location.store.root
        return plan.given_up(self._ctx.location_name, root, self._s.config.state_dir)
