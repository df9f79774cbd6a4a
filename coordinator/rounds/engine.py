"""The round engine of one job: open, collect, close, publish, repeat; and recover.

One :class:`JobEngine` per job runs as a task the job manager owns. Each round r:

1. **Open**: choose participants (quarantine), the adaptive deadline, persist the round
   record, announce it (retained). Deltas already accepted for r (an earlier attempt,
   a restart) count at once.
2. **Collect**: the upload path hands over verified, durable deltas
   (:meth:`JobEngine.accept`); each acceptance commits the receipt, the round state and
   an audit entry in one transaction. The engine ticks the round state machine on every
   acceptance and at its deadline: close, extend, or fail below quorum.
   A job that merges late deltas (``aggregation.late: merge``) takes a delta for an
   earlier round into the open one (:mod:`coordinator.rounds.late`), at its staleness
   weight, and closes a round a grace window after its quorum arrived.
3. **Publish**: :mod:`coordinator.publication.publisher` computes, stores and commits the
   update. θ_r is evaluated where the job says (:mod:`coordinator.publication.evaluation`):
   by default a region evaluated it before training and its delta carries the metrics; the
   coordinator evaluates only what is its (the last θ, or each under ``where: coordinator``).

What to do next is decided by :func:`coordinator.rounds.driver.next_step`, a pure
function of the job's facts; the engine carries its steps out. A round that fails below
quorum is re-opened (a new attempt, keeping accepted deltas) up to ``max_round_attempts``
times, then the job fails. A publication that fails keeps the round closed and is tried
again after a back-off (``publication_retry``), from θ_r's working state rebuilt from
storage (the outer step is taken in its tensors). Pausing abandons the collecting round;
resuming re-opens it. Every state change is decided under one lock, persisted, announced.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, assert_never

from coordinator.aggregation.accumulator import RoundAccumulator, RoundKey
from coordinator.aggregation.outer_round import DeltaSource
from coordinator.aggregation.robust import folds_on_arrival
from coordinator.errors import Unavailable
from coordinator.jobs.capacity_records import (
    PREEMPTING_POINTER,
    record_job_preempted,
    record_preemption_pending,
)
from coordinator.jobs.context import JobContext
from coordinator.jobs.recovery import (
    load_working_state,
    past_rounds,
    rebuilt_working_state,
    recover_rounds,
)
from coordinator.jobs.regions import membership_of, with_membership
from coordinator.jobs.status import job_status, shards_status
from coordinator.jobs.theta_zero import ThetaZeroRefused, create_theta_zero
from coordinator.publication.evaluation import JobEvaluation
from coordinator.publication.publisher import PublicationFailed, RoundPublisher
from coordinator.publication.snapshots import JobSnapshots
from coordinator.residency import checkpoint_storage
from coordinator.rounds.acceptance import accepted_again, refusal
from coordinator.rounds.deadline import RoundTiming, next_deadline
from coordinator.rounds.driver import Step, next_step
from coordinator.rounds.job_scheduling import JobScheduling
from coordinator.rounds.late import grace_window, still_behind
from coordinator.rounds.past_rounds import PastRounds
from coordinator.rounds.quarantine import Outcome, Quarantine, round_outcomes
from coordinator.rounds.records import JobState, RoundRecord, job_announcement
from coordinator.rounds.state import (
    Action,
    DeltaVerdict,
    DeltaVerdictCode,
    JobIntake,
    RoundConfig,
    RoundDecision,
    RoundPhase,
    RoundState,
    judge_delta,
)
from coordinator.scheduling.elastic import Membership
from coordinator.services import Services
from coordinator.state.audit import AuditEvent, AuditVerdict
from coordinator.state.store import MAX_POINTER_VALUE, ConflictError, Receipt
from coordinator.state.transactions import DeltaOffer, accept_delta, record_job_failure
from coordinator.storage.working_state import WorkingState
from geofed.control.messages import AnnouncedPhase
from geofed.timeouts import wait_event

__all__ = ["DeltaOffer", "JobEngine"]

log = logging.getLogger(__name__)


async def _nothing(reason: str) -> None: ...


class JobEngine:
    """Drives the rounds of one job (see the module docstring)."""

    def __init__(
        self,
        services: Services,
        ctx: JobContext,
        state: JobState,
        *,
        scheduling: JobScheduling,
        on_yield: Callable[[str], Awaitable[None]] = _nothing,
    ) -> None:
        self._s = services
        self.ctx = ctx
        #: The job as submitted; ``ctx`` is it on the regions of the round in progress.
        self.submitted = ctx
        #: The job's regions and shard slots as the operators set them (durable); the
        #: next round runs on them. ``applied`` is what the current round runs on.
        self.membership = Membership.initial(ctx.spec.regions, ctx.spec.region_slots)
        self.applied = self.membership
        #: Whether ``membership`` was read from the store (the engine recovered it).
        self.membership_loaded = False
        self._state = state
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        #: Set once the engine settled: a round collecting, the job paused, or ended.
        self.ready = asyncio.Event()
        #: Set once the job's state was read back (or its recovery failed): before, the
        #: engine knows neither its round nor its parameters.
        self.recovered = asyncio.Event()
        self.working: WorkingState | None = None
        self.record: RoundRecord | None = None
        self.update_digest: str | None = None
        self.last_error = ""
        self._history: deque[RoundTiming] = deque(maxlen=ctx.spec.deadline.window_rounds)
        self._quarantine = Quarantine(services.config.quarantine)
        self._evaluation = JobEvaluation(services, ctx)
        #: When the job takes its snapshots (coordinator.publication.snapshots), and why.
        self.snapshots = JobSnapshots(services, ctx, self._serving, self._evaluation.history)
        self._publisher = RoundPublisher(services, ctx, self.snapshots)
        self._announced: tuple[int, str, float] | None = None
        #: When the next try of a failed publication is due (wall clock); None otherwise.
        self._publication_retry_at: float | None = None
        #: The open round's accepted deltas, summed as they arrived (in memory only).
        self._accumulator: RoundAccumulator | None = None
        aggregation = ctx.spec.aggregation
        #: The published rounds a late delta may still merge against (their θ hashes).
        self.past = PastRounds(aggregation.max_staleness if aggregation.late == "merge" else 0)
        self.scheduling = scheduling
        #: Why the job is to give its regions back at its next round boundary (a
        #: preemption); None when it is not. ``on_yield`` is awaited once it did (the job
        #: manager's admission pass: the job's place in the queue, the regions' next job).
        self.preempting: str | None = None
        self._on_yield = on_yield
        #: The version of the round being opened: from the moment its participants are
        #: chosen until it is recorded, a change of regions waits for the next boundary.
        self._opening: int | None = None

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

    async def await_recovered(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for this job's state to be read back, else 503 (until
        then a restarted job knows only the regions it was submitted with)."""
        await wait_event(self.recovered, wait_s)
        self._refuse_while_recovering()

    def _refuse_while_recovering(self) -> None:
        if not self.recovered.is_set():
            # Not a 409: a region takes that as final for the round (a straggler), and the
            # round it uploads to may well be the one about to be recovered as open.
            raise Unavailable(f"job {self.job} is being recovered; try again shortly")

    def check_open(self, region: str, round: int) -> DeltaVerdict:
        """The verdict on a delta of ``region`` for ``round`` now; raise the 409 (or 503)
        it gets when refused, 503 while recovering."""
        self._refuse_while_recovering()
        verdict = judge_delta(self.round_state, region, round, self._s.clock(), self._intake())
        if not verdict.accepted:
            raise refusal(verdict)
        return verdict

    def status(self) -> dict[str, Any]:
        """The job as ``GET /v1/jobs/{job}`` shows it."""
        spec = self.ctx.spec
        body = job_status(
            job=self.job,
            state=self._state,
            version=self.version,
            rounds=spec.rounds,
            regions=spec.regions,
            params_hash=self.working.params_hash if self.working else None,
            location=self.ctx.location_name,
            val_loss=self._evaluation.val_loss,
            val_history=self._evaluation.history,
            error=self.last_error,
            quarantined=self.quarantined(),
            record=self.record,
            evaluation=self._evaluation.metrics,
        )
        body.update(self.scheduling.status())
        body["preempting"] = self.preempting  # why it stops at its next boundary, if it does
        body["snapshot"] = self.snapshots.status(self.version)
        body["shards"] = shards_status(self.submitted.spec, self.applied, self.membership)
        return body

    def adopt(self, membership: Membership) -> bool:
        """Take regions the manager has already stored: at once when no round of the
        current version was opened yet, else at the next round boundary. True: at once."""
        self.membership = membership
        if self.round_opened():
            return False
        self._apply(membership)
        return True

    def round_opened(self) -> bool:
        """Whether a round of the current version was opened (region changes then wait)."""
        if self._opening == self.version:
            return True
        rs = self.round_state
        return rs is not None and rs.config.round == self.version

    def _apply(self, membership: Membership) -> None:
        """Run on ``membership``'s regions from now on (a round boundary)."""
        if membership == self.applied:
            return
        self.ctx = with_membership(
            self.submitted, self.submitted.spec, membership, self._s.runtime.policies
        )
        self._publisher = RoundPublisher(self._s, self.ctx, self.snapshots)
        self.applied = membership
        members, shards = ", ".join(membership.members), dict(membership.assignment)
        log.info("job %s runs on %s (shards %s)", self.job, members, shards)

    def _serving(self, region: str) -> bool:
        """Whether ``region`` serves the job now (its failures count for its snapshots)."""
        return self._state is JobState.RUNNING and region in self.ctx.spec.regions

    def quarantined(self) -> dict[str, str]:
        """The job's regions in quarantine for the current round now, each with why."""
        if self._state.final:
            return {}
        now, version = self._s.clock(), self.version
        verdicts = (self._quarantine.status(r, version, now) for r in self.ctx.spec.region_names)
        return {v.region: v.reason for v in verdicts if v.quarantined}

    def _intake(self) -> JobIntake:
        stopped = "" if self._state is JobState.RUNNING else self._state.value
        return self.past.intake(self.job, self.version, stopped)

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

    @property
    def folds_on_arrival(self) -> bool:
        """Whether accepted deltas are summed as they arrive."""
        return folds_on_arrival(self.ctx.spec.aggregation)

    async def accept(self, offer: DeltaOffer) -> Receipt:
        """Count a delta in its round; commit receipt, round and audit entry together.

        The delta, verified and durable, is then folded into the round's running sum
        (:mod:`coordinator.aggregation.accumulator`) when the job's rule allows.
        """
        async with self._lock:
            verdict = self.check_open(offer.region, offer.round)
            record = self.record
            if record is None:  # check_open found an open round; nothing awaited since
                raise RuntimeError(f"job {self.job}: no open round")
            before = record.state.model_copy(deep=True)
            now = self._s.clock()
            merged = verdict.code is DeltaVerdictCode.MERGED
            if not merged:
                verdict = record.state.on_delta(offer.region, offer.round, now)
            existing = None
            if merged or verdict.code is DeltaVerdictCode.DUPLICATE:
                # A late one may have been merged into an earlier round already.
                existing = await self._s.db.receipt(self.job, offer.round, offer.region)
            if merged and existing is None:
                record.state.merge(offer.region, offer.round, now)
            elif existing is not None or verdict.code is DeltaVerdictCode.DUPLICATE:
                return accepted_again(
                    existing,
                    offer.manifest_digest,
                    job=self.job,
                    round=offer.round,
                    region=offer.region,
                )
            if not verdict.accepted:
                raise refusal(verdict)
            rs = record.state
            try:
                receipt = await self._s.db.run(
                    accept_delta, self.job, offer, record.to_dict(), verdict.reason, rs.config.round
                )
            except BaseException:
                record.state = before  # the round never saw this delta
                raise
            if self.folds_on_arrival:
                late = rs.config.round - offer.round
                own = offer.round if late else None
                source = DeltaSource(offer.region, offer.tokens, offer.blob_digest, own, late)
                await self._fold(source, (rs.config.round, rs.config.opened_at))
        metrics = self._s.metrics
        metrics.deltas_accepted.labels(job=self.job, region=offer.region).inc()
        if merged:
            metrics.late_merged.labels(job=self.job, region=offer.region).inc()
        metrics.fp32_equivalent_bytes.labels(direction="received").inc(
            self.ctx.round_fp32_bytes(offer.round)
        )
        if offer.train_loss is not None:
            metrics.region_train_loss.labels(job=self.job, region=offer.region).set(
                offer.train_loss
            )
        if offer.base_eval is not None:
            self._evaluation.record(offer.round, offer.base_eval)  # θ_r, evaluated by the region
        self._wake.set()
        return receipt

    async def _fold(self, source: DeltaSource, key: RoundKey) -> None:
        """Fold an accepted delta into its round's sum, under the lock (arrival order).

        The acceptance is committed already: a failed fold only costs the round its
        shortcut (the publisher decodes the durable deltas instead).
        """
        accumulator = self._accumulator
        if accumulator is None or accumulator.key != key:
            accumulator = self._accumulator = RoundAccumulator(key, self.ctx.round_shapes(key[0]))
        pieces = self.ctx.stored_delta(key[0], source.blob_digest)
        try:
            await self._s.executors.compute(accumulator.fold, source.key, source.weight, pieces)
        except asyncio.CancelledError:
            accumulator.abandon(f"folding {source.key}'s delta was cancelled")
            raise
        except Exception:
            log.warning(
                "job %s round %d: the delta of %s was accepted but not folded; the round "
                "will decode its deltas again at publication",
                self.job,
                key[0],
                source.key,
                exc_info=True,
            )

    # -- the driver ---------------------------------------------------------------

    async def run(self) -> None:
        """Recover, then drive rounds until the job ends; failures mark the job failed."""
        try:
            started = time.monotonic()
            await self._recover()
            self.recovered.set()
            log.info(
                "job %s at round %d (%s): its state was loaded in %.2f s",
                self.job,
                self.version,
                self._state.value,
                time.monotonic() - started,
            )
            if self.collecting() is not None and self._state is JobState.RUNNING:
                await self._announce("open")  # the retained message may predate a restart
            await self._drive()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not (self._state.final and not self.recovered.is_set()):  # ended before: kept
                log.exception("job %s failed", self.job, extra={"job": self.job})
                await self._fail_job(f"{type(exc).__name__}: {exc}")
            else:
                self.last_error = f"cannot be read back: {type(exc).__name__}: {exc}"
                log.exception("job %s (%s) cannot be read back", self.job, self._state.value)
        finally:
            self.recovered.set()  # a failed recovery answers as the failed job it left
            self.ready.set()
            self._export_quarantine()  # an ended job holds no region back
            self._s.runtime.traces.ended(self.job, self._s.clock())
            await self._evaluation.stop()

    async def _drive(self) -> None:
        """Carry out :func:`~coordinator.rounds.driver.next_step` until it says stop."""
        while True:
            record = self.record
            step, reason = next_step(
                self._s.clock(),
                self._state,
                self.version,
                self.ctx.spec.rounds,
                self.round_state,
                self._publication_retry_at,
                failures=record.failures if record is not None else 0,
                max_round_attempts=self.ctx.spec.max_round_attempts,
            )
            log.debug("job %s: %s: %s", self.job, step, reason)
            if step is Step.END:
                return
            if step is Step.QUEUED:
                self.ready.set()
                await self._sleep(None)  # the job manager wakes it: admitted or cancelled
                continue
            if step is Step.OPEN and self.preempting is not None:
                await self._yield_regions(self.preempting)  # at a boundary: nothing is lost
                continue
            if step is Step.PUBLISH:
                self._publication_retry_at = None
                await self._publish()  # finish what closed, whatever was asked since
            elif step is Step.AWAIT_RETRY:
                self.ready.set()
                await self._sleep(self._publication_retry_at)
            elif step is Step.CANCEL:
                # A closed round is abandoned too: it only waits to retry its publication.
                await self._stop_round(reason, "cancelled", RoundPhase.AGGREGATING)
                return
            elif step is Step.PAUSE:
                await self._stop_round(reason, "paused")
                self.ready.set()
                await self._sleep(None)
                retry_at = self._publication_retry_at
                if retry_at is not None:  # a resume tries again at once: space may be freed
                    self._publication_retry_at = min(retry_at, self._s.clock())
            elif step is Step.COMPLETE:
                await self._complete()
                return
            elif step is Step.FAIL:
                await self._fail_job(reason)
                return
            elif step is Step.OPEN:
                await self._open_round()
            elif step is Step.TICK:
                self.ready.set()
                decision = await self._tick()
                if decision.action is Action.WAIT:
                    await self._sleep(decision.wake_at)
            else:
                assert_never(step)

    async def _sleep(self, wake_at: float | None) -> None:
        """Wait until ``wake_at`` (wall clock) or until something wakes the engine."""
        timeout = None if wake_at is None else max(0.0, wake_at - self._s.clock()) + 0.01
        await wait_event(self._wake, timeout)
        self._wake.clear()

    # -- recovery and initialisation ------------------------------------------------

    async def _recover(self) -> None:
        """Load the job's working state (or create θ_0) and what its rounds left behind."""
        self._s.metrics.job_started(self.job, self.ctx.spec.regions)
        await self._s.runtime.faults.reached("recover", self._s.config.state_dir, self.job, 0)
        db = self._s.db
        pointers = await db.list_pointers(self.job)
        self.membership = membership_of(self.submitted.spec, pointers)
        self.membership_loaded = True
        if "version" not in pointers:
            if self._state.final:
                return  # it ended before θ_0 existed: nothing to recover
            await self._initialize()
            if self.working is None:
                return
        else:
            self.working = await load_working_state(self._s, self.ctx, pointers)
        found = await recover_rounds(self._s, self.ctx, self.version)
        await self.snapshots.recover()
        if found.last_checkpoint_at is not None:
            self._s.metrics.last_checkpoint.labels(job=self.job).set(found.last_checkpoint_at)
        self.update_digest = found.update_digest
        self._history.extend(found.history)
        if found.quarantine is not None:
            self._quarantine = found.quarantine
        self.record = found.record
        if self.past.reach:
            self.past.restore(await past_rounds(self._s, self.job, self.version, self.past.reach))
        self._apply(self._round_membership())
        self._evaluation.restore(pointers)
        if self._state is JobState.RUNNING and pointers.get(PREEMPTING_POINTER):
            self.preempting = pointers[PREEMPTING_POINTER]  # decided before a restart
        self._s.metrics.current_round.labels(job=self.job).set(self.version)
        self._export_quarantine()

    async def _initialize(self) -> None:
        """θ_0 (:mod:`coordinator.jobs.theta_zero`), once its storage is allowed."""
        if not await self._storage_allowed(0):
            return
        try:
            self.working = await create_theta_zero(self._s, self.ctx)
        except ThetaZeroRefused as exc:
            await self._fail_job(str(exc))
            return
        self._evaluation.later(self.working)  # θ_0, when the coordinator is the one to evaluate it

    async def _storage_allowed(self, round: int) -> bool:
        """May this job's checkpoints go to its location? The job fails if not."""
        decision = await self._s.residency.decide(
            checkpoint_storage(self.ctx), actor=self._s.actor, job=self.job, round=round
        )
        if not decision.allowed:
            await self._fail_job(f"checkpoint storage refused: {decision}")
        return decision.allowed

    # -- rounds ---------------------------------------------------------------------

    def _round_membership(self) -> Membership:
        """The regions the round of the current version opened on (they stay its regions
        whatever joins or leaves meanwhile); the job's own when none is open."""
        if not self.round_opened() or self.record is None:
            return self.membership
        config = self.record.state.config
        if config.shards is None or config.shard_count is None:
            return self.membership  # a round recorded before shards were
        return Membership(config.shard_count, config.shards, self.membership.datasets)

    async def _open_round(self) -> None:
        """Open (or re-open) round ``version``, on the job's regions as they stand now."""
        self._apply(self.membership)  # a round boundary: regions join and leave here
        self._opening = self.version
        try:
            await self._open_applied_round()
        finally:
            self._opening = None

    async def _open_applied_round(self) -> None:
        version = self.version
        previous = (
            self.record if self.record and self.record.state.config.round == version else None
        )
        now = self._s.clock()
        spec = self.ctx.spec
        selection = self._quarantine.select(spec.region_names, version, now, spec.quorum)
        deadline_s, reason = next_deadline(list(self._history), spec.deadline)
        grace_s = None
        if self.past.reach:
            quorum = min(spec.quorum, len(selection.participants))
            grace_s, why = grace_window(list(self._history), quorum, spec.aggregation.grace_s)
            reason += f"; {why}"
        config = RoundConfig(
            round=version,
            participants=selection.participants,
            min_regions=min(spec.quorum, len(selection.participants)),
            opened_at=now,
            deadline_s=deadline_s,
            shards=dict(self.applied.assignment),
            shard_count=self.applied.slots,
            base_hash=self.working.params_hash if self.working is not None else None,
            grace_s=grace_s,
        )
        rs = RoundState.open(config)
        receipts = await self._s.db.list_receipts(self.job, version)
        for receipt in receipts:
            if receipt.region in config.participants:
                rs.on_delta(receipt.region, version, now)
        for late in previous.state.merged if previous is not None else ():
            rs.arrivals.append(late)  # merged into this round: in every attempt of it
        record = RoundRecord(
            state=rs,
            attempt=(previous.attempt + 1) if previous is not None else 1,
            failures=previous.failures if previous is not None else 0,
            deadline_reason=reason + (f"; {selection.reason}" if selection.excluded else ""),
            quarantine=self._quarantine,
            publication_failures=previous.publication_failures if previous is not None else 0,
        )
        async with self._lock:
            await self._s.db.save_round(self.job, version, record.to_dict())
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

    async def _tick(self) -> RoundDecision:
        async with self._lock:
            record = self.record
            if record is None:
                raise RuntimeError(f"job {self.job}: no round to tick")
            rs, views = record.state, self._s.control.regions if self.past.reach else {}
            behind = still_behind(views, self.job, rs.config.round, self.past.received(rs))
            decision = rs.tick(self._s.clock(), behind)
            if decision.action in (Action.WAIT, Action.IDLE):
                return decision
            if decision.action is Action.FAIL:
                record.failures += 1
            await self._s.db.save_round(self.job, record.state.config.round, record.to_dict())
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
            details = {"reason": decision.reason, "failures": record.failures}
            event = AuditEvent(self._s.actor, "round.fail", AuditVerdict.ERROR, self.job, round_)
            await self._s.db.append_audit(replace(event, details=details))
        return decision

    # -- publication (the work is coordinator.publication.publisher's) ------------------------

    async def _publish(self) -> None:
        record, working = self.record, self.working
        if record is None or working is None:
            raise RuntimeError(f"job {self.job}: nothing to publish")
        rs = record.state
        await self._announce("closed")
        if not await self._storage_allowed(rs.config.round):
            return
        accumulator, self._accumulator = self._accumulator, None
        if accumulator is not None and accumulator.key != (rs.config.round, rs.config.opened_at):
            accumulator = None
        if not working.params:  # spent by a failed try: θ_r again, as after a restart
            try:
                working = self.working = await rebuilt_working_state(self._s, self.ctx, working)
            except Exception as exc:
                await self._publication_failed(record, PublicationFailed(exc))
                return
        # The step is taken in θ_r's own tensors: nothing may still be reading them.
        await self._evaluation.params_released()
        try:
            computed = await self._publisher.compute(record, working, accumulator)
        except PublicationFailed as failure:
            self.working = working.spent()  # its tensors hold part of θ_{r+1}: let them go
            del working
            traceback.clear_frames(failure.cause.__traceback__)
            await self._publication_failed(record, failure)
            return
        published = computed.published
        now = self._s.clock()
        old = await self._s.db.list_pointers(self.job)
        async with self._lock:
            rs.mark_published(now)
            late = {a.region for a in rs.merged}
            for region, outcome in round_outcomes(rs.included, rs.stragglers, late).items():
                self._record_outcome(region, rs.config.round, outcome, now)
            record.quarantine = self._quarantine
            completed = published.state.version >= self.ctx.spec.rounds
            await self._publisher.commit(record, published, completed=completed)
            self.past.remember(rs)
            self.working = published.state
            self.update_digest = published.update.manifest_digest
            if record.publication_failures:
                self.last_error = ""  # it described the publication's retries, now over
            if completed:
                self._state = JobState.COMPLETED
        await self._publisher.finish(record, computed, old)
        timing = rs.timing()
        if timing is not None:
            self._history.append(timing)
        if self._state is JobState.COMPLETED:
            await self._s.control.event("job.completed", job=self.job, round=self.version)
        self._evaluation.later(published.state)

    async def _publication_failed(self, record: RoundRecord, failure: PublicationFailed) -> None:
        """Schedule the next try of the round's publication, or fail the job past the bound."""
        now = self._s.clock()
        async with self._lock:
            plan = await self._publisher.record_failure(record, failure, now)
        await self._publisher.report_failure(plan, failure)
        if plan.exhausted:
            await self._fail_job(self._publisher.given_up(plan))
            return
        self._publication_retry_at = plan.retry_at
        self.last_error = plan.waiting

    async def preempt(self, reason: str) -> None:
        """Give the regions back at the next round boundary (the round in progress ends
        and is published first); the job then waits in the queue, as it stood. Stored
        first, so a coordinator restarted before the boundary still stops it there."""
        await self._s.db.run(record_preemption_pending, self.job, reason[:MAX_POINTER_VALUE])
        self.preempting = reason
        self._wake.set()

    async def _yield_regions(self, reason: str) -> None:
        """At a boundary: the job goes back to the queue (persisted, audited), regions hold."""
        self.preempting = None
        try:
            await self._s.db.run(
                record_job_preempted, self.job, self._s.actor, reason, self.version
            )
        except ConflictError:
            return  # paused or cancelled meanwhile: that state wins
        self._state = JobState.QUEUED
        log.info("job %s preempted before round %d: %s", self.job, self.version, reason)
        await self._on_yield(reason)
        await self._announce("paused")
        await self._s.control.event(
            "job.preempted", job=self.job, round=self.version, detail=reason
        )

    # -- ending rounds and jobs -------------------------------------------------------

    async def _stop_round(self, reason: str, announced: AnnouncedPhase, *also: RoundPhase) -> None:
        """Abandon the collecting round (and one in ``also``), then announce the job's state."""
        async with self._lock:
            record = self.record
            if record is not None and record.state.phase in (RoundPhase.COLLECTING, *also):
                record.state.abandon(self._s.clock(), reason)
                await self._s.db.save_round(self.job, record.state.config.round, record.to_dict())
        await self._announce(announced)

    async def _complete(self) -> None:
        """The job ran all its rounds (the publishing transaction usually recorded it)."""
        # The last parameters' evaluation is the job's result: let it finish, not cancel it
        # (and start it, if a coordinator killed after the last publication never kept it).
        if self.working is not None:
            self._evaluation.ensure(self.working)
        await self._evaluation.finish()
        if self._state is not JobState.COMPLETED:
            await self._s.db.set_job_state(self.job, JobState.COMPLETED.value)
            self._state = JobState.COMPLETED
        await self._announce("done")

    async def _fail_job(self, reason: str) -> None:
        self.last_error = reason
        self._state = JobState.FAILED
        try:
            await self._s.db.run(record_job_failure, self.job, self._s.actor, reason)
        except Exception:
            log.exception("job %s: cannot record its failure", self.job)
        if self.working is not None:
            await self._announce("cancelled")
        await self._s.control.event("job.failed", job=self.job, detail=reason)

    async def _announce(self, phase: AnnouncedPhase) -> None:
        working = self.working
        if working is None:
            return
        rs = self.round_state
        key = (self.version, phase, rs.deadline_at if rs is not None else 0.0)
        if key == self._announced:
            return
        trace = None
        if phase == "open" and rs is not None and rs.config.round == self.version:
            # The open round's traceparent (its span started when first announced open).
            traces, opened_at = self._s.runtime.traces, rs.config.opened_at
            trace = traces.traceparent(self.job, self.version, opened_at, self._s.clock())
        message = job_announcement(
            self.ctx.spec,
            self.applied,
            self.job,
            self.version,
            params_hash=working.params_hash,
            update_digest=self.update_digest,
            round_state=rs,
            state=phase,
            now=self._s.clock(),
            task_fingerprint=self.ctx.task_fingerprint,
            trace=trace,
        )
        await self._s.control.announce(message)
        self._announced = key
