"""The round driver of one job: open, collect, close, publish, repeat; and recover.

One :class:`JobEngine` per job runs as a task the job manager owns. Each round r:

1. **Open**: choose participants (quarantine), the adaptive deadline, persist the round
   record, announce it (retained). Deltas already accepted for r (an earlier attempt,
   a restart) count at once.
2. **Collect**: the upload path hands over verified, durable deltas
   (:meth:`JobEngine.accept`); each acceptance commits the receipt, the round state and
   an audit entry in one transaction. The engine ticks the round state machine on every
   acceptance and at its deadline: close, extend, or fail below quorum.
3. **Publish**: aggregate from the durable spool in canonical order, outer step, encode,
   sign and store the update (and snapshots), then one transaction marks round r
   published *and* moves the job's pointers to θ_{r+1}: a round is applied exactly once,
   and a crash before that transaction makes the restarted engine recompute the same
   round bit for bit. θ_{r+1} is evaluated in the background afterwards.

A round that fails below quorum is re-opened (a new attempt, keeping accepted deltas)
up to ``max_round_attempts`` times, then the job fails. A publication that fails (the
checkpoint storage is full or unwritable) keeps the round closed with the same deltas
and is tried again after an exponential back-off (``publication_retry`` in the
coordinator config), up to its own bound of attempts, then the job fails. Pausing
abandons the collecting round; resuming re-opens it. Every state change is decided under
one lock, persisted, then announced.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from datetime import UTC, datetime
from typing import Any

from coordinator.audit import Verdict, format_time
from coordinator.checkpoints import EntryKind
from coordinator.context import JobContext, initial_parameters
from coordinator.deadline import RoundTiming, next_deadline
from coordinator.errors import Conflict
from coordinator.evaluation import evaluate_params
from coordinator.outer_optimizer import OuterOptimizer
from coordinator.params import ParamsStore, WorkingState
from coordinator.publisher import DeltaSource, PublishedRound, publish_initial, publish_round
from coordinator.quarantine import Outcome, Quarantine
from coordinator.records import JobState, RoundRecord, announcement
from coordinator.round_state import (
    Action,
    Decision,
    RoundConfig,
    RoundPhase,
    RoundState,
    VerdictCode,
)
from coordinator.services import Services
from coordinator.spool import Spool
from coordinator.store import Receipt
from coordinator.transactions import (
    DeltaOffer,
    accept_delta,
    record_initial,
    record_job_failure,
    record_publication,
)
from geofed.control.messages import RoundState as AnnouncedState
from geofed.types import ArtifactKind
from policies import Transfer, decide_transfer

__all__ = ["DeltaOffer", "JobEngine"]

log = logging.getLogger(__name__)

VAL_LOSS_POINTER = "val_loss"
VAL_HISTORY_POINTER = "val_loss_history"
#: How long a finished job waits for the evaluation of its last parameters.
FINAL_EVALUATION_WAIT_S = 600.0
_STATE_POINTERS = ("version", "params", "params_hash", "outer_state", "ef_residual")


class JobEngine:
    """Drives the rounds of one job (see the module docstring)."""

    def __init__(self, services: Services, ctx: JobContext, state: JobState) -> None:
        self._s = services
        self.ctx = ctx
        self._state = state
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        #: Set once the engine settled: a round collecting, the job paused, or ended.
        self.ready = asyncio.Event()
        self.working: WorkingState | None = None
        self.record: RoundRecord | None = None
        self.update_digest: str | None = None
        self.val_loss: tuple[int, float] | None = None
        self.val_history: dict[int, float] = {}
        self.last_error = ""
        self._history: deque[RoundTiming] = deque(maxlen=ctx.spec.deadline.window_rounds)
        self._quarantine = Quarantine(services.config.quarantine)
        self._background: set[asyncio.Task[None]] = set()
        self._announced: tuple[int, str, float] | None = None
        #: When the next try of a failed publication is due (wall clock); None otherwise.
        self._publication_retry_at: float | None = None

    # -- what the API reads -------------------------------------------------------

    @property
    def job(self) -> str:
        return self.ctx.job

    @property
    def state(self) -> JobState:
        return self._state

    @property
    def version(self) -> int:
        return self.working.version if self.working is not None else 0

    @property
    def round_state(self) -> RoundState | None:
        return self.record.state if self.record is not None else None

    def collecting(self) -> RoundState | None:
        """The round that takes deltas now, if any."""
        rs = self.round_state
        if rs is not None and rs.config.round == self.version and rs.phase is RoundPhase.COLLECTING:
            return rs
        return None

    def check_open(self, region: str, round: int) -> None:
        """Raise the 409 a delta of ``region`` for ``round`` would get now (read-only)."""
        if self._state is not JobState.RUNNING:
            raise Conflict(f"job {self.job} is {self._state}; it takes no deltas", "round_closed")
        if round < self.version:
            raise Conflict(
                f"round {round} of job {self.job} is over; the current round is {self.version}",
                "round_closed",
            )
        rs = self.round_state
        if round > self.version or rs is None or rs.config.round != round:
            raise Conflict(
                f"round {round} of job {self.job} is not open (current round {self.version})",
                "wrong_round",
            )
        if region not in rs.config.participants:
            raise Conflict(
                f"{region} is not a participant of round {round} of job {self.job} "
                f"(participants: {', '.join(rs.config.participants)})",
                "not_participant",
            )
        if rs.phase is not RoundPhase.COLLECTING and region not in rs.delivered:
            raise Conflict(
                f"round {round} of job {self.job} is {rs.phase} without {region}; "
                f"join round {round + 1}",
                "round_closed",
            )

    def status(self) -> dict[str, Any]:
        """The job as ``GET /v1/jobs/{job}`` shows it."""
        spec = self.ctx.spec
        body: dict[str, Any] = {
            "job": self.job,
            "state": self._state.value,
            "round": self.version,
            "rounds": spec.rounds,
            "params_hash": self.working.params_hash if self.working else None,
            "checkpoint_location": self.ctx.location_name,
            "regions": {region: list(datasets) for region, datasets in spec.regions.items()},
            "global_val_loss": None,
            "error": self.last_error or None,
        }
        if self.val_loss is not None:
            body["global_val_loss"] = {"round": self.val_loss[0], "value": self.val_loss[1]}
        body["val_loss_history"] = [
            {"round": number, "value": value} for number, value in sorted(self.val_history.items())
        ]
        body["quarantined"] = self.quarantined()
        record = self.record
        if record is not None:
            rs = record.state
            body["current"] = {
                "round": rs.config.round,
                "phase": rs.phase.value,
                "attempt": record.attempt,
                "participants": list(rs.config.participants),
                "delivered": list(rs.delivered),
                "min_regions": rs.config.min_regions,
                "deadline": datetime.fromtimestamp(rs.deadline_at, UTC).isoformat(),
                "deadline_reason": record.deadline_reason,
                "end_reason": rs.end_reason or None,
            }
        return body

    def quarantined(self) -> dict[str, str]:
        """The job's regions in quarantine for the current round now, each with why."""
        if self._state.final:
            return {}
        now, version = self._s.clock(), self.version
        verdicts = (self._quarantine.status(r, version, now) for r in self.ctx.spec.region_names)
        return {v.region: v.reason for v in verdicts if v.quarantined}

    def _export_quarantine(self) -> None:
        quarantined = self.quarantined()
        gauge = self._s.metrics.region_quarantined
        for region in self.ctx.spec.region_names:
            gauge.labels(job=self.job, region=region).set(1 if region in quarantined else 0)

    def _record_outcome(self, region: str, round: int, outcome: Outcome, now: float) -> None:
        decision = self._quarantine.record(region, round, outcome, now)
        if decision.changed:
            log.warning("job %s: %s", self.job, decision.reason)

    # -- commands -----------------------------------------------------------------

    def set_state(self, state: JobState) -> None:
        """Take a job state the manager has already persisted, and act on it."""
        self._state = state
        self._wake.set()

    async def accept(self, offer: DeltaOffer) -> Receipt:
        """Count a delta in its round; commit receipt, round and audit entry together."""
        async with self._lock:
            self.check_open(offer.region, offer.round)
            record = self.record
            if record is None:  # check_open found an open round; nothing awaited since
                raise RuntimeError(f"job {self.job}: no open round")
            before = record.state.model_copy(deep=True)
            verdict = record.state.on_delta(offer.region, offer.round, self._s.clock())
            if verdict.code is VerdictCode.DUPLICATE:
                return await self._duplicate(offer)
            if not verdict.accepted:
                raise Conflict(verdict.reason, _CONFLICT_CODES[verdict.code])
            try:
                receipt = await self._s.executors.db(
                    accept_delta, self._s.store, self.job, offer, record.to_dict(), verdict.reason
                )
            except BaseException:
                record.state = before  # the round never saw this delta
                raise
        metrics = self._s.metrics
        metrics.deltas_accepted.labels(job=self.job, region=offer.region).inc()
        metrics.fp32_equivalent_bytes.labels(direction="received").inc(self.ctx.fp32_bytes)
        if offer.train_loss is not None:
            metrics.region_train_loss.labels(job=self.job, region=offer.region).set(
                offer.train_loss
            )
        self._wake.set()
        return receipt

    async def _duplicate(self, offer: DeltaOffer) -> Receipt:
        receipts = await self._s.executors.db(self._s.store.list_receipts, self.job, offer.round)
        existing = next((r for r in receipts if r.region == offer.region), None)
        if existing is not None and existing.manifest_digest == offer.manifest_digest:
            return existing
        raise Conflict(
            f"{offer.region} already has a different delta accepted for round {offer.round} "
            f"of job {self.job}",
            "already_accepted",
        )

    # -- the driver ---------------------------------------------------------------

    async def run(self) -> None:
        """Recover, then drive rounds until the job ends; failures mark the job failed."""
        try:
            await self._recover()
            if self.collecting() is not None and self._state is JobState.RUNNING:
                await self._announce("open")  # the retained message may predate a restart
            await self._drive()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("job %s failed", self.job, extra={"job": self.job})
            await self._fail_job(f"{type(exc).__name__}: {exc}")
        finally:
            self.ready.set()
            self._export_quarantine()  # an ended job holds no region back
            for task in list(self._background):
                task.cancel()
            if self._background:
                await asyncio.wait(self._background)

    async def _drive(self) -> None:
        while self._state is not JobState.FAILED:
            rs = self.round_state
            current = rs is not None and rs.config.round == self.version
            if rs is not None and current and rs.phase is RoundPhase.AGGREGATING:
                retry_at = self._publication_retry_at
                if retry_at is None:
                    await self._publish()  # finish what closed, whatever was asked since
                elif self._state is JobState.CANCELLED:
                    await self._stop_round("job cancelled by an operator", "cancelled", True)
                    return
                elif self._state is JobState.PAUSED:
                    await self._announce("paused")
                    self.ready.set()
                    await self._sleep(None)
                    # A resume tries again at once: the operator may have freed space.
                    self._publication_retry_at = min(retry_at, self._s.clock())
                elif self._s.clock() >= retry_at:
                    self._publication_retry_at = None
                else:
                    self.ready.set()
                    await self._sleep(retry_at)
                continue
            if self._state is JobState.CANCELLED:
                await self._stop_round("job cancelled by an operator", "cancelled")
                return
            if self.version >= self.ctx.spec.rounds or self._state is JobState.COMPLETED:
                await self._complete()
                return
            if self._state is JobState.PAUSED:
                await self._stop_round("job paused by an operator", "paused")
                self.ready.set()
                await self._sleep(None)
                continue
            if rs is None or not current or rs.phase is not RoundPhase.COLLECTING:
                if not await self._open_round():
                    return
                continue
            self.ready.set()
            decision = await self._tick()
            if decision.action is Action.WAIT:
                await self._sleep(decision.wake_at)

    async def _sleep(self, wake_at: float | None) -> None:
        """Wait until ``wake_at`` (wall clock) or until something wakes the engine."""
        timeout = None if wake_at is None else max(0.0, wake_at - self._s.clock()) + 0.01
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)
        self._wake.clear()

    # -- recovery and initialisation ------------------------------------------------

    async def _recover(self) -> None:
        self._s.metrics.job_started(self.job, self.ctx.spec.regions)
        db = self._s.executors.db
        store = self._s.store
        pointers = await db(store.list_pointers, self.job)
        if "version" not in pointers:
            if self._state.final:
                return  # it ended before θ_0 existed: nothing to recover
            await self._initialize()
            if self.working is None:
                return
        else:
            self.working = await self._s.executors.compute(self._params.load, pointers)
        version = self.version
        location = self.ctx.publishing.location
        entries = await self._s.executors.files(location.store.entries, self.job)
        if entries:
            last = max(entry.recorded_at for entry in entries)
            self._s.metrics.last_checkpoint.labels(job=self.job).set(last)
        previous = [e for e in entries if e.kind is EntryKind.UPDATE and e.round == version - 1]
        self.update_digest = previous[0].manifest_digest if previous else None
        quarantine_config = self._s.config.quarantine
        start = max(0, version - self.ctx.spec.deadline.window_rounds)
        for number in range(start, version + 1):
            saved = await db(store.load_round, self.job, number)
            if saved is None:
                continue
            record = RoundRecord.from_dict(saved.state, quarantine_config)
            timing = record.state.timing()
            if number < version and timing is not None:
                self._history.append(timing)
            self._quarantine = record.quarantine
            if number == version:
                self.record = record
        loss = pointers.get(VAL_LOSS_POINTER)
        if loss:
            round_text, _, value = loss.partition(":")
            self.val_loss = (int(round_text), float(value))
            self._s.metrics.global_validation_loss.labels(job=self.job).set(float(value))
        history = pointers.get(VAL_HISTORY_POINTER)
        if history:
            self.val_history = {int(k): float(v) for k, v in json.loads(history).items()}
        self._s.metrics.current_round.labels(job=self.job).set(version)
        self._export_quarantine()

    @property
    def _params(self) -> ParamsStore:
        return self.ctx.publishing.params_store

    async def _initialize(self) -> None:
        """θ_0 from the task, its snapshot (round 0), and the job's first pointers."""
        if not await self._storage_decision(0):
            return
        spec = self.ctx.spec
        params = await self._s.executors.compute(initial_parameters, self.ctx.task, spec.seed)
        optimizer = OuterOptimizer(spec.outer_optimizer)
        state, pointers, snapshot = await self._s.executors.compute(
            publish_initial, self.ctx.publishing, params, optimizer, datetime.now(UTC)
        )
        details = {
            "snapshot": snapshot.bundle_digest,
            "params_hash": state.params_hash,
            "location": self.ctx.location_name,
        }
        await self._s.executors.db(
            record_initial, self._s.store, self.job, pointers, self._s.actor, details
        )
        self.working = state
        self._s.metrics.last_checkpoint.labels(job=self.job).set(time.time())
        self._evaluate_later(state)  # the initial loss: what training is measured against

    async def _storage_decision(self, round: int) -> bool:
        """May this job's checkpoints go to its location? Decided, counted and audited."""
        transfer = Transfer(
            ArtifactKind.GLOBAL_CHECKPOINT,
            self.ctx.coordinator_endpoint(),
            self.ctx.storage_endpoint(),
            self.ctx.provenance(),
        )
        decision = decide_transfer(self._s.runtime.policies, transfer)
        await self._s.policy_decision(
            decision,
            kind=ArtifactKind.GLOBAL_CHECKPOINT.value,
            actor=self._s.actor,
            job=self.job,
            round=round,
        )
        if not decision.allowed:
            await self._fail_job(f"checkpoint storage refused: {decision}")
        return decision.allowed

    # -- rounds ---------------------------------------------------------------------

    async def _open_round(self) -> bool:
        """Open (or re-open) round ``version``; False when the job failed instead."""
        version = self.version
        previous = (
            self.record if self.record and self.record.state.config.round == version else None
        )
        failures = previous.failures if previous is not None else 0
        if previous is not None and failures >= self.ctx.spec.max_round_attempts:
            last = previous.state.end_reason
            await self._fail_job(f"round {version} failed {failures} time(s); last: {last}")
            return False
        now = self._s.clock()
        spec = self.ctx.spec
        selection = self._quarantine.select(spec.region_names, version, now, spec.quorum)
        deadline_s, reason = next_deadline(list(self._history), spec.deadline)
        config = RoundConfig(
            round=version,
            participants=selection.participants,
            min_regions=min(spec.quorum, len(selection.participants)),
            opened_at=now,
            deadline_s=deadline_s,
        )
        rs = RoundState.open(config)
        receipts = await self._s.executors.db(self._s.store.list_receipts, self.job, version)
        for receipt in receipts:
            if receipt.region in config.participants:
                rs.on_delta(receipt.region, version, now)
        record = RoundRecord(
            state=rs,
            attempt=(previous.attempt + 1) if previous is not None else 1,
            failures=failures,
            deadline_reason=reason + (f"; {selection.reason}" if selection.excluded else ""),
            quarantine=self._quarantine,
            publication_failures=previous.publication_failures if previous is not None else 0,
        )
        async with self._lock:
            await self._s.executors.db(
                self._s.store.save_round, self.job, version, record.to_dict()
            )
            self.record = record
        self._s.metrics.current_round.labels(job=self.job).set(version)
        self._export_quarantine()
        log.info(
            "job %s round %d open (attempt %d): %s; deadline %.1f s: %s",
            self.job,
            version,
            record.attempt,
            ", ".join(config.participants),
            deadline_s,
            reason,
        )
        await self._announce("open")
        await self._s.control.event(
            "round.opened", job=self.job, round=version, detail=f"attempt {record.attempt}"
        )
        return True

    async def _tick(self) -> Decision:
        async with self._lock:
            record = self.record
            if record is None:
                raise RuntimeError(f"job {self.job}: no round to tick")
            decision = record.state.tick(self._s.clock())
            if decision.action in (Action.WAIT, Action.IDLE):
                return decision
            if decision.action is Action.FAIL:
                record.failures += 1
            await self._s.executors.db(
                self._s.store.save_round, self.job, record.state.config.round, record.to_dict()
            )
        round_ = record.state.config.round
        log.info("job %s round %d: %s: %s", self.job, round_, decision.action, decision.reason)
        if decision.action is Action.CLOSE:
            await self._announce("closed")
            await self._s.control.event(
                "round.closed", job=self.job, round=round_, detail=decision.reason
            )
        elif decision.action is Action.EXTEND:
            await self._announce("open")
        elif decision.action is Action.FAIL:
            self._s.metrics.rounds_failed.labels(job=self.job).inc()
            timing = record.state.timing()
            if timing is not None:
                self._history.append(timing)  # its stragglers make the next deadline grow
            for region in decision.stragglers:
                self._record_outcome(region, round_, Outcome.STRAGGLER, self._s.clock())
            await self._s.audit(
                actor=self._s.actor,
                action="round.fail",
                verdict=Verdict.ERROR,
                job=self.job,
                round=round_,
                details={"reason": decision.reason, "failures": record.failures},
            )
        return decision

    async def _publish(self) -> None:
        record, working = self.record, self.working
        if record is None or working is None:
            raise RuntimeError(f"job {self.job}: nothing to publish")
        rs = record.state
        round_ = rs.config.round
        await self._announce("closed")
        if not await self._storage_decision(round_):
            return
        receipts = await self._s.executors.db(self._s.store.list_receipts, self.job, round_)
        sources = [
            DeltaSource(r.region, r.tokens, r.blob_digest)
            for r in receipts
            if r.region in rs.included
        ]
        faults, state_dir = self._s.runtime.faults, self._s.config.state_dir
        await faults.reached("aggregate", state_dir, self.job, round_)
        started = time.monotonic()
        try:
            published = await self._s.executors.compute(
                publish_round, self.ctx.publishing, working, sources, datetime.now(UTC)
            )
        except Exception as exc:
            await self._publication_failed(record, exc)
            return
        elapsed = time.monotonic() - started
        await faults.reached("publish", state_dir, self.job, round_)
        await self._commit_publication(record, published)
        if record.publication_failures:
            log.info(
                "job %s round %d published after %d failed attempt(s)",
                self.job,
                round_,
                record.publication_failures,
            )
        await self._s.executors.files(self._discard_inputs, round_, sources)
        metrics = self._s.metrics
        metrics.aggregation_duration.labels(job=self.job).observe(elapsed)
        metrics.rounds_completed.labels(job=self.job).inc()
        metrics.round_duration.labels(job=self.job).observe(
            max(0.0, (rs.ended_at or self._s.clock()) - rs.config.opened_at)
        )
        metrics.current_round.labels(job=self.job).set(self.version)
        metrics.last_checkpoint.labels(job=self.job).set(time.time())
        for region in rs.stragglers:
            metrics.stragglers.labels(job=self.job, region=region).inc()
        timing = rs.timing()
        if timing is not None:
            self._history.append(timing)
        log.info(
            "job %s round %d published from %s in %.2f s: θ_%d hash %s",
            self.job,
            round_,
            ", ".join(rs.included),
            elapsed,
            round_ + 1,
            published.state.params_hash[:16],
        )
        await self._s.control.event(
            "round.published", job=self.job, round=round_, detail=published.update.bundle_digest
        )
        if self._state is JobState.COMPLETED:
            await self._s.control.event("job.completed", job=self.job, round=self.version)
        self._evaluate_later(published.state)

    async def _commit_publication(self, record: RoundRecord, published: PublishedRound) -> None:
        rs = record.state
        now = self._s.clock()
        old = await self._s.executors.db(self._s.store.list_pointers, self.job)
        async with self._lock:
            rs.mark_published(now)
            for region in rs.included:
                self._record_outcome(region, rs.config.round, Outcome.DELIVERED, now)
            for region in rs.stragglers:
                self._record_outcome(region, rs.config.round, Outcome.STRAGGLER, now)
            record.quarantine = self._quarantine
            completed = published.state.version >= self.ctx.spec.rounds
            details = {
                "update": published.update.bundle_digest,
                "update_manifest": published.update.manifest_digest,
                "snapshot": published.snapshot.bundle_digest if published.snapshot else None,
                "params_hash": published.state.params_hash,
                "included": list(rs.included),
                "stragglers": list(rs.stragglers),
                "tokens": published.tokens,
                "location": self.ctx.location_name,
            }

            await self._s.executors.db(
                record_publication,
                self._s.store,
                self.job,
                rs.config.round,
                record.to_dict(),
                published.pointers,
                completed=completed,
                actor=self._s.actor,
                details=details,
            )
            self.working = published.state
            self.update_digest = published.update.manifest_digest
            if record.publication_failures:
                self.last_error = ""  # it described the publication's retries, now over
            if completed:
                self._state = JobState.COMPLETED
        kept = {name: published.pointers[name] for name in _STATE_POINTERS}
        await self._s.executors.files(self._params.delete, old, kept)

    def _discard_inputs(self, round: int, sources: list[DeltaSource]) -> None:
        """A published round's deltas and abandoned uploads are no longer needed."""
        try:
            Spool(self._s.runtime.spool_dir).discard_round(self.job, round)
            for source in sources:
                self._s.runtime.deltas.delete(source.blob_digest)
        except OSError as exc:
            log.warning(
                "job %s round %d: cannot discard its spooled deltas: %s", self.job, round, exc
            )

    async def _publication_failed(self, record: RoundRecord, exc: Exception) -> None:
        """Count a failed publication; schedule the next try, or fail the job past the bound.

        The round stays closed with its deltas: the next try aggregates the same ones, and
        the artifacts a failed try stored are reused. The regions' ``max_round_attempts``
        is not spent on the coordinator's storage trouble.
        """
        retry = self._s.config.publication_retry
        reason = f"{type(exc).__name__}: {exc}"
        round_ = record.state.config.round
        now = self._s.clock()
        async with self._lock:
            record.publication_failures += 1
            failures = record.publication_failures
            exhausted = failures >= retry.max_attempts
            if exhausted:
                record.state.fail(now, f"publication failed: {reason}")
            await self._s.executors.db(self._s.store.save_round, self.job, round_, record.to_dict())
        delay = retry.delay_s(failures)
        retry_at = now + delay
        self._s.metrics.rounds_failed.labels(job=self.job).inc()
        await self._s.audit(
            actor=self._s.actor,
            action="round.fail",
            verdict=Verdict.ERROR,
            job=self.job,
            round=round_,
            details={
                "reason": reason,
                "publication_failures": failures,
                "max_attempts": retry.max_attempts,
                "retry_in_s": None if exhausted else delay,
                "retry_at": None if exhausted else format_time(retry_at),
            },
        )
        if exhausted:
            root = self.ctx.publishing.location.store.root
            log.error(
                "job %s round %d: publication attempt %d of %d failed: %s",
                self.job,
                round_,
                failures,
                retry.max_attempts,
                reason,
                exc_info=exc,
            )
            await self._fail_job(
                f"round {round_} could not be published: all {failures} attempt(s) allowed by "
                f"publication_retry.max_attempts failed; last: {reason}. Free space (or fix "
                f"permissions) in the checkpoint location {self.ctx.location_name} ({root}) "
                f"and the state directory ({self._s.config.state_dir}), then submit the job "
                f"again; its checkpoints up to round {round_} remain. To ride out longer "
                f"outages, raise publication_retry in the coordinator config."
            )
            return
        self._publication_retry_at = retry_at
        when = datetime.fromtimestamp(retry_at, UTC).isoformat(timespec="seconds")
        self.last_error = (
            f"publication of round {round_} failed (attempt {failures} of "
            f"{retry.max_attempts}): {reason}; retrying at {when} (in {delay:g} s)"
        )
        log.warning(
            "job %s round %d: publication attempt %d of %d failed: %s; next attempt in %g s, at %s",
            self.job,
            round_,
            failures,
            retry.max_attempts,
            reason,
            delay,
            when,
            exc_info=exc,
        )

    async def _stop_round(
        self, reason: str, announced: AnnouncedState, closed_too: bool = False
    ) -> None:
        """Abandon the collecting round (pause, cancel) and announce the job's state.

        ``closed_too`` also abandons a closed round (one waiting to retry its publication).
        """
        phases = (
            (RoundPhase.COLLECTING, RoundPhase.AGGREGATING)
            if closed_too
            else (RoundPhase.COLLECTING,)
        )
        async with self._lock:
            record = self.record
            if record is not None and record.state.phase in phases:
                record.state.abandon(self._s.clock(), reason)
                await self._s.executors.db(
                    self._s.store.save_round, self.job, record.state.config.round, record.to_dict()
                )
        await self._announce(announced)

    async def _complete(self) -> None:
        """The job ran all its rounds (the publishing transaction usually recorded it)."""
        # The last parameters' evaluation is the job's result: let it finish, not cancel it.
        pending = {t for t in self._background if t.get_name().startswith("evaluate-")}
        if pending:
            await asyncio.wait(pending, timeout=FINAL_EVALUATION_WAIT_S)
        if self._state is not JobState.COMPLETED:
            await self._s.executors.db(
                self._s.store.set_job_state, self.job, JobState.COMPLETED.value
            )
            self._state = JobState.COMPLETED
        await self._announce("done")

    async def _fail_job(self, reason: str) -> None:
        self.last_error = reason
        self._state = JobState.FAILED

        try:
            await self._s.executors.db(
                record_job_failure, self._s.store, self.job, self._s.actor, reason
            )
        except Exception:
            log.exception("job %s: cannot record its failure", self.job)
        if self.working is not None:
            await self._announce("cancelled")
        await self._s.control.event("job.failed", job=self.job, detail=reason)

    async def _announce(self, state: AnnouncedState) -> None:
        working = self.working
        if working is None:
            return
        spec = self.ctx.spec
        rs = self.round_state
        key = (self.version, state, rs.deadline_at if rs is not None else 0.0)
        if key == self._announced:
            return
        message = announcement(
            job=self.job,
            version=self.version,
            params_hash=working.params_hash,
            update_digest=self.update_digest,
            round_state=rs,
            state=state,
            regions=spec.region_names,
            quorum=spec.quorum,
            inner_steps=spec.inner_steps,
            codec=spec.codec.announced(),
            task=spec.task.spec,
            task_options=spec.task.options,
            seed=spec.seed,
            default_deadline_s=spec.deadline.initial_s,
            now=self._s.clock(),
        )
        await self._s.control.announce(message)
        self._announced = key

    # -- evaluation -------------------------------------------------------------------

    def _evaluate_later(self, state: WorkingState) -> None:
        task = asyncio.create_task(
            self._evaluate(state), name=f"evaluate-{self.job}-{state.version}"
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _evaluate(self, state: WorkingState) -> None:
        try:
            metrics = await self._s.executors.compute(
                evaluate_params, self.ctx.task, self.ctx.spec.seed, state.params
            )
        except Exception:
            log.exception("job %s: evaluating θ_%d failed", self.job, state.version)
            return
        loss = metrics.get("val_loss")
        if loss is None:
            return
        self.val_history[state.version] = float(loss)
        history = json.dumps({str(k): v for k, v in sorted(self.val_history.items())})
        await self._s.executors.db(
            self._s.store.set_pointer, self.job, VAL_HISTORY_POINTER, history
        )
        # Evaluations may finish out of order; the gauge shows the newest parameters'.
        if self.val_loss is not None and self.val_loss[0] > state.version:
            return
        self.val_loss = (state.version, float(loss))
        self._s.metrics.global_validation_loss.labels(job=self.job).set(float(loss))
        await self._s.executors.db(
            self._s.store.set_pointer,
            self.job,
            VAL_LOSS_POINTER,
            f"{state.version}:{float(loss)!r}",
        )


_CONFLICT_CODES = {
    VerdictCode.LATE: "round_closed",
    VerdictCode.NOT_PARTICIPANT: "not_participant",
    VerdictCode.WRONG_ROUND: "wrong_round",
}
