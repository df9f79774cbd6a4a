"""Jobs: submission with residency admission, pause, resume, cancel, and their engines.

Submission parses the spec off the event loop (file:line:key errors), checks it against
this coordinator (:mod:`coordinator.jobs.submission_checks`: task modules it allows, before
anything is imported; storage locations it knows; deadlines against its timeouts; teams
and classes), asks the policy engine whether every region's
policy admits the job as placed (a refusal names the rule), loads
the task, records the job with the checkpoint location admission allows (the first
allowed candidate, in the spec's order), audits the admission, and starts the job's
:class:`~coordinator.rounds.engine.JobEngine`. The manager owns every engine task and cancels
them on shutdown.

Capacity: a job whose spec states ``needs`` is recorded ``queued`` and its engine waits;
an admission pass (:func:`coordinator.jobs.capacity.admission_pass`, pure) decides which
queued jobs start, and the manager starts them (``job.admit`` audited with the reason),
and which running jobs to preempt: each stops at its next round boundary and goes back
to the queue (:meth:`coordinator.rounds.engine.JobEngine.preempt`).
A pass runs when a job is submitted, cancelled or ends, when a region's status changes
whether it is up or what it offers, and at start-up; every waiting job's place and reason
is kept for ``GET /v1/jobs/{job}`` and ``GET /v1/queue``
(:mod:`coordinator.jobs.queue_view`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from coordinator.costs.estimate import outlook_json
from coordinator.errors import ApiError, BadRequest, Conflict, Forbidden, NotFound, Unavailable
from coordinator.jobs.capacity import (
    JobFacts,
    QueueEntry,
    RegionFacts,
    admission_pass,
    capacity_json,
    in_use,
    job_facts,
    join_capacity_refusal,
    training_phase,
)
from coordinator.jobs.capacity_records import record_job_start, record_queued_job
from coordinator.jobs.context import JobContext, JobContextError, build_context
from coordinator.jobs.init_source import InitError, load_initial
from coordinator.jobs.legacy_blobs import adopt_legacy_blobs
from coordinator.jobs.queue_view import (
    Listed,
    gpus_held,
    queue_rows,
    queue_waits,
    waiting_per_priority,
)
from coordinator.jobs.regions import record_region_change
from coordinator.jobs.spec import JobSpec, JobSpecError, parse_job_spec, parse_stored_spec
from coordinator.jobs.submission_checks import (
    SubmissionChecks,
    check_task_module,
    configured_location,
    gpus_needed,
    overridden,
)
from coordinator.jobs.usage import RunLedger
from coordinator.rounds.engine import JobEngine
from coordinator.rounds.job_scheduling import JobScheduling
from coordinator.rounds.records import JobState
from coordinator.rounds.region_refusals import RegionRefusals
from coordinator.scheduling import SchedulingConfig
from coordinator.scheduling.config import load_scheduling_config
from coordinator.scheduling.elastic import RegionChange, decide_change, joined_provenance
from coordinator.scheduling.quota import team_gpu_hours
from coordinator.scheduling.teams import (
    DEFAULT_TEAM,
    management_refusal,
)
from coordinator.services import Services
from coordinator.state.audit import AuditEntry, AuditEvent, AuditVerdict
from coordinator.state.store import AlreadyExists, ConflictError
from coordinator.state.transactions import LOCATION_POINTER, record_admitted_job, record_job_change
from geofed.blobstore import BlobStoreError
from geofed.timeouts import wait_event
from geofed.types import Identity, InvalidName, validate_name
from policies import JobPlacement, PlacementError, StorageLocation, admit_job

__all__ = ["JobManager"]

log = logging.getLogger(__name__)
Action = Literal["pause", "resume", "cancel"]
#: How often a pass runs while jobs wait, without any event asking for one.
REPLAN_EVERY_S = 60.0

#: action -> (states it applies to, resulting state, command sent to the job's regions)
_TRANSITIONS: dict[str, tuple[frozenset[JobState], JobState, Action]] = {
    "pause": (frozenset({JobState.RUNNING}), JobState.PAUSED, "pause"),
    "resume": (frozenset({JobState.PAUSED}), JobState.RUNNING, "resume"),
    "cancel": (
        frozenset({JobState.QUEUED, JobState.RUNNING, JobState.PAUSED}),
        JobState.CANCELLED,
        "cancel",
    ),
}


class JobManager:
    """Every job of this coordinator and the task of each engine."""

    def __init__(self, services: Services) -> None:
        self._s = services
        self._engines: dict[str, JobEngine] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._unavailable: dict[str, str] = {}
        #: The stored jobs started with this coordinator (readiness waits for their state).
        self._restored: set[str] = set()
        self._submitting = asyncio.Lock()
        self._scheduling = SchedulingConfig()
        self._claims: dict[str, tuple[str, ...]] = {}
        self._submitted: dict[str, float] = {}
        self._queue: dict[str, QueueEntry] = {}
        self._planning = asyncio.Lock()
        self._changing_regions = asyncio.Lock()
        self._replan_wanted = asyncio.Event()
        self._replan_why: dict[str, None] = {}  # why passes were asked for, in order
        self._planner: asyncio.Task[None] | None = None
        self._ledger = RunLedger()  # when jobs held GPUs: GPU-hour quotas
        self._checks = SubmissionChecks(services, lambda: self._scheduling)

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Load the scheduling config; rebuild and start the engine of every stored job."""
        config = await asyncio.to_thread(load_scheduling_config, self._s.config.scheduling)
        self._scheduling = config
        records = await self._s.db.list_jobs()
        try:
            await adopt_legacy_blobs(self._s, [record.job_id for record in records])
        except (OSError, BlobStoreError) as exc:  # the jobs still read the shared store
            log.warning("the jobs could not adopt the shared store's blobs: %s", exc)
        for record in records:
            self._submitted[record.job_id] = record.created_at
            try:
                spec = parse_stored_spec(record.spec)
                check_task_module(spec, self._s)
                location = await self._s.db.get_pointer(record.job_id, LOCATION_POINTER)
                ctx = await self._s.executors.compute(
                    build_context, spec, self._s.runtime, configured_location(location, self._s)
                )
            except (JobSpecError, JobContextError) as exc:
                self._unavailable[record.job_id] = str(exc)
                log.error("job %s cannot be resumed: %s", record.job_id, exc)  # noqa: TRY400
                continue
            self._restored.add(record.job_id)
            self._launch(ctx, JobState(record.state))
        self._count_states()
        await self._replay_usage(records)
        await self._replan("the coordinator started")
        self._s.control.on_region_change(
            lambda region: self._request_pass(f"region {region} changed (up or capacity)")
        )
        self._s.control.on_region_refusal(RegionRefusals(self._s.db, self._s.config.federation))
        self._planner = asyncio.create_task(self._plan_on_request(), name="admission")

    async def _replay_usage(self, records: Iterable[Any]) -> None:
        """Rebuild the GPU run spans from the audit log (only with GPU-hour quotas)."""
        if not any(q.gpu_hours is not None for q in self._scheduling.teams.values()):
            return
        teams: dict[str, str] = {}
        regions: dict[str, tuple[str, ...]] = {}
        gpus: dict[str, dict[str, int]] = {}
        every = tuple(self._s.runtime.policies)
        for job, engine in self._engines.items():
            spec = engine.submitted.spec  # as submitted: the audit log has the changes
            if spec.needs is not None:
                teams[job] = spec.team_name
                regions[job] = spec.region_names
                # Any region may join it later: each holds what the spec needs there.
                gpus[job] = {region: gpus_needed(spec, region) for region in every}
        finished = {
            record.job_id: record.updated_at
            for record in records
            if record.job_id in gpus and JobState(record.state).final
        }
        entries: list[AuditEntry] = []
        after = 0
        while True:
            page = await self._s.db.audit_entries(after, 1000)
            if not page:
                break
            entries.extend(e for e in page if e.job in gpus)
            after = page[-1].seq
        self._ledger.replay(entries, teams, regions, gpus, finished)

    async def stop(self) -> None:
        """Cancel every engine (and the admission task) and wait for them."""
        tasks = list(self._tasks.values())
        if self._planner is not None:
            tasks.append(self._planner)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _launch(self, ctx: JobContext, state: JobState) -> JobEngine:
        facts = job_facts(ctx.spec, state, 0.0, self._scheduling)
        engine = JobEngine(
            self._s,
            ctx,
            state,
            scheduling=JobScheduling(priority=facts.priority, team=facts.team),
            on_yield=lambda reason: self._after_yield(ctx.job),
        )
        self._engines[ctx.job] = engine
        task = asyncio.create_task(self._run(engine), name=f"job-{ctx.job}")
        self._tasks[ctx.job] = task
        return engine

    async def _run(self, engine: JobEngine) -> None:
        await engine.run()
        self._ledger.stopped(engine.job, self._s.clock())
        self._count_states()
        if engine.ctx.spec.needs is not None:  # its capacity is free: start what now fits
            self._request_pass(f"job {engine.job} {engine.state.value}")

    # -- queries --------------------------------------------------------------------

    def engine(self, job: str) -> JobEngine:
        """The engine of ``job``; 404 if there is no such job."""
        try:
            validate_name("job", job)
        except InvalidName as exc:
            raise BadRequest(str(exc)) from None
        engine = self._engines.get(job)
        if engine is None:
            if job in self._unavailable:
                raise ApiError(
                    503, "unavailable", f"job {job} is unavailable: {self._unavailable[job]}"
                )
            raise NotFound(f"no job {job}")
        return engine

    def engines(self) -> Iterable[JobEngine]:
        return list(self._engines.values())

    def unavailable(self) -> dict[str, str]:
        return dict(self._unavailable)

    def recovering(self) -> list[str]:
        """The stored jobs this coordinator started with whose state is not read back yet."""
        return sorted(
            job
            for job in self._restored
            if (engine := self._engines.get(job)) is not None and not engine.recovered.is_set()
        )

    def _count_states(self) -> None:
        counts = dict.fromkeys((state.value for state in JobState), 0)
        for engine in self._engines.values():
            counts[engine.state.value] += 1
        for state, count in counts.items():
            self._s.metrics.jobs.labels(state=state).set(count)

    # -- submission -----------------------------------------------------------------

    async def submit(
        self, text: str, actor: Identity, overrides: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """Admit and start a job; raise the ApiError that explains a refusal.

        ``overrides``: ``priority`` and/or ``team`` replacing the spec's (the command
        line's ``--priority``/``--team``)."""
        try:
            # Bounded, but a hostile body is slow to parse: never on the event loop.
            spec = await self._s.executors.parse(parse_job_spec, text, "request")
        except JobSpecError as exc:
            raise BadRequest(
                f"invalid job spec: {exc}", extra={"problems": list(exc.problems)}
            ) from None
        if overrides:
            spec = overridden(spec, overrides)
        self._checks.local(spec)
        spec = await self._checks.team(spec, actor)
        async with self._submitting:
            if spec.job in self._engines or spec.job in self._unavailable:
                raise Conflict(f"job {spec.job} already exists", "already_exists")
            spec = await self._resolve_init(spec, actor)
            admission = self._checks.admit(spec)
            await self._checks.record_refusal(spec, admission, actor)
            if not admission.admitted:
                first = admission.denials[0]
                raise ApiError(
                    403,
                    "policy_denied",
                    f"job {spec.job} refused: {first.reason} [rule {first.rule.rule_id} at "
                    f"{first.rule.origin}]",
                    {"denials": [decision.as_dict() for decision in admission.denials]},
                )
            allowed = {location.name for location in admission.checkpoint_storage}
            location = next(name for name in spec.checkpoint_storage if name in allowed)
            try:
                ctx = await self._s.executors.compute(
                    build_context, spec, self._s.runtime, location
                )
            except JobContextError as exc:
                raise BadRequest(f"job {spec.job}: {exc}") from None
            # A job stating needs waits for capacity; one stating none starts at once.
            queued = spec.needs is not None
            try:
                await self._s.db.run(
                    record_queued_job if queued else record_admitted_job,
                    spec.job,
                    spec.to_json(),
                    location,
                    actor,
                    len(admission.decisions),
                )
            except AlreadyExists:
                raise Conflict(f"job {spec.job} already exists", "already_exists") from None
            self._submitted[spec.job] = self._s.clock()
            engine = self._launch(ctx, JobState.QUEUED if queued else JobState.RUNNING)
        if queued:
            await self._replan(f"job {spec.job} submitted")
        # θ_0 and round 0 are usually ready in well under a second; answer then.
        await wait_event(engine.ready, self._s.config.timeouts.request_s)
        self._count_states()
        log.info("job %s admitted; checkpoints in %s", spec.job, location)
        await self._s.control.event("job.admitted", job=spec.job, detail=f"by {actor}")
        return {
            "job": spec.job,
            "state": engine.state.value,
            "checkpoint_location": location,
            "decisions": len(admission.decisions),
            **engine.scheduling.status(),
            "cost_estimate": self.cost_estimate(engine),
        }

    async def _resolve_init(self, spec: JobSpec, actor: Identity) -> JobSpec:
        """The spec with its ``init_from`` source read, verified and recorded: the round it
        names, θ_0's hash and what the source derives from (400 when it cannot be; 403,
        audited, when the source job's model is another team's)."""
        source = spec.init_from
        if source is None:
            return spec
        location = version = None
        if source.job is not None:
            engine = self._engines.get(source.job)
            if engine is not None:
                # Starting from a job's model takes it away as an export does.
                await self._check_manager(engine, "export", actor)
            if engine is not None and engine.working is not None:
                location, version = engine.ctx.publishing.location, engine.version
        try:
            state = await self._s.executors.files(
                load_initial,
                source,
                job_location=location,
                job_version=version,
                import_dirs=self._s.config.import_dirs,
                trust=self._s.runtime.bundle,
            )
        except InitError as exc:
            raise BadRequest(f"job {spec.job}: {exc}") from None
        recorded = source.model_copy(
            update={
                "round": version
                if source.job is not None and source.round is None
                else source.round,
                "params_hash": state.params_hash,
                "provenance": state.provenance,
                "location": None if location is None else location.name,
            }
        )
        log.info(
            "job %s: θ_0 from %s (parameters hash %s)", spec.job, state.source, state.params_hash
        )
        return spec.model_copy(update={"init_from": recorded})

    # -- pause, resume, cancel ---------------------------------------------------------

    async def change(self, job: str, action: str, actor: Identity) -> dict[str, Any]:
        """Pause, resume or cancel ``job``; 409 ``invalid_state`` when it does not apply."""
        engine = self.engine(job)
        if action not in _TRANSITIONS:
            raise BadRequest(f"unknown job action {action!r}; use pause, resume or cancel")
        await self._check_manager(engine, action, actor)
        allowed, target, command = _TRANSITIONS[action]
        current = engine.state
        if current not in allowed:
            raise Conflict(
                f"job {job} is {current.value}; {action} applies to "
                f"{' or '.join(sorted(s.value for s in allowed))} jobs",
                "invalid_state",
            )
        try:
            await self._s.db.run(record_job_change, job, action, current, target, actor)
        except ConflictError as exc:
            raise Conflict(f"job {job} changed meanwhile: {exc}", "invalid_state") from None
        engine.set_state(target)
        if target is JobState.CANCELLED:
            self._ledger.stopped(job, self._s.clock())
        self._count_states()
        for region in engine.ctx.spec.region_names:
            await self._s.control.command(region, command, job, f"{action} by {actor}")
        if target is JobState.CANCELLED and engine.ctx.spec.needs is not None:
            await self._replan(f"job {job} cancelled")
        return {"job": job, "state": target.value}

    async def _check_manager(self, engine: JobEngine, action: str, actor: Identity) -> None:
        """403 ``forbidden`` (audited) unless ``actor`` may ``action`` the job (its team)."""
        team = engine.ctx.spec.team_name
        refusal = management_refusal(actor, action, engine.job, team, self._s.config.admins)
        if refusal is not None:
            await self._checks.deny(actor, f"job.{action}", engine.job, refusal)
            raise Forbidden(refusal)

    async def preempt(self, job: str, actor: Identity) -> dict[str, Any]:
        """Stop a running capacity-scheduled job at its next round boundary and put it
        back in the queue (admins only); it starts again when a pass admits it."""
        engine = self.engine(job)
        await self._check_manager(engine, "preempt", actor)
        if engine.ctx.spec.needs is None:
            raise Conflict(
                f"job {job} states no needs, so it holds no capacity to give back; pause it",
                "invalid_state",
            )
        if engine.state is not JobState.RUNNING:
            raise Conflict(
                f"job {job} is {engine.state.value}; preempt applies to running jobs",
                "invalid_state",
            )
        reason = f"preempted by {actor}"
        if engine.preempting is None:
            log.info("job %s to be preempted: %s", job, reason)
            await engine.preempt(reason)
            self._s.metrics.preemptions.labels(priority=engine.scheduling.priority).inc()
        return {"job": job, "state": engine.state.value, "preempting": engine.preempting}

    # -- regions joining and leaving -------------------------------------------------

    async def change_regions(
        self, job: str, change: RegionChange, actor: Identity
    ) -> dict[str, Any]:
        """Add a region to ``job`` or remove one, from its next round boundary.

        Authorized as other job management (the job's team or an admin); a join is
        decided by residency as at admission and, for a job stating needs, by the
        capacity free in the region. Every refusal is audited (``job.regions``, deny,
        with why) and changes nothing.
        """
        engine = self.engine(job)
        await self._check_manager(engine, "regions", actor)
        if not engine.membership_loaded:
            raise Unavailable(f"job {job} is starting; retry shortly")
        async with self._changing_regions:
            submitted = engine.submitted.spec
            decision = decide_change(
                change,
                engine.membership,
                job=job,
                ended=engine.state.value if engine.state.final else "",
                min_regions=submitted.quorum,
                known_regions=frozenset(self._s.runtime.policies),
                evaluation_region=submitted.evaluation.region,
            )
            if decision.membership is None:
                await self._refuse_change(engine, change, actor, decision.reason, decision.details)
                raise ApiError(
                    decision.status,
                    decision.code,
                    decision.reason,
                    {"refusal": str(decision.refusal)},
                )
            if change.action == "add":
                await self._check_join(engine, change, actor)
            details: dict[str, Any] = {
                "action": change.action,
                "reason": decision.reason,
                "slot": decision.slot,
            }
            if change.action == "add":
                details["datasets"] = list(change.datasets)
            await self._s.db.run(
                record_region_change, job, change.region, decision.membership, actor, details
            )
            at_once = engine.adopt(decision.membership)
            in_progress = None if at_once else engine.version
            # When it takes effect is the engine's to say, as it adopts the change.
            reason = decision.reason + (
                ", now (no round of the current version was open)"
                if at_once
                else f", from the next round boundary (round {in_progress} in progress keeps "
                "its participants)"
            )
        log.info("job %s: %s by %s", job, reason, actor)
        await self._s.control.event("job.regions", job=job, region=change.region, detail=reason)
        if engine.ctx.spec.needs is not None:
            self._request_pass(f"job {job}: {change.action} {change.region}")
        return {
            "job": job,
            "action": change.action,
            "region": change.region,
            "slot": decision.slot,
            "effective": "now" if at_once else "next_round",
            "round_in_progress": in_progress,  # keeps its participants
            "reason": reason,
            "shards": engine.status()["shards"],
        }

    async def _check_join(self, engine: JobEngine, change: RegionChange, actor: Identity) -> None:
        """Residency (as at admission, with the job's checkpoint location) and capacity
        for ``change.region`` joining; a refusal is audited and raised."""
        spec = engine.submitted.spec
        regions = joined_provenance(engine.membership, change.region, change.datasets)
        location = engine.ctx.publishing.location
        storage = StorageLocation(location.name, location.jurisdiction, location.region)
        try:
            placement = JobPlacement.build(regions, self._s.config.jurisdiction, [storage])
        except PlacementError as exc:
            raise BadRequest(f"region change: {exc}") from None
        admission = admit_job(self._s.runtime.policies, placement)
        for each in admission.decisions:
            self._s.metrics.policy_decision(each.allowed, "admission")
        if not admission.admitted:
            first = admission.denials[0]
            reason = (
                f"residency policy refuses {change.region} joining {engine.job}: {first.reason} "
                f"[rule {first.rule.rule_id} at {first.rule.origin}]"
            )
            denials = [each.as_dict() for each in admission.denials]
            await self._refuse_change(engine, change, actor, reason, {"denials": denials})
            raise ApiError(403, "policy_denied", reason, {"denials": denials})
        uncounted = self._checks.uncounted(spec, [change.region])
        if uncounted is not None:
            await self._refuse_change(engine, change, actor, uncounted, {})
            raise Forbidden(uncounted)
        need = spec.need_in(change.region)
        if need is None:
            return
        lack = join_capacity_refusal(change.region, need, self._regions(), self._facts())
        if lack is not None:
            reason = f"{change.region} lacks the capacity {engine.job} needs: {lack}"
            await self._refuse_change(engine, change, actor, reason, {})
            raise ApiError(409, "invalid_state", reason, {"refusal": "capacity"})

    async def _refuse_change(
        self,
        engine: JobEngine,
        change: RegionChange,
        actor: Identity,
        reason: str,
        details: Mapping[str, Any],
    ) -> None:
        log.warning(
            "refused %s of region %s to job %s: %s",
            change.action,
            change.region,
            engine.job,
            reason,
        )
        await self._s.db.append_audit(
            AuditEvent(
                actor=actor,
                action="job.regions",
                verdict=AuditVerdict.DENY,
                job=engine.job,
                region=change.region,
                details={"action": change.action, "reason": reason, **details},
            )
        )

    # -- capacity admission ------------------------------------------------------------

    def _facts(self) -> list[JobFacts]:
        return [
            job_facts(
                engine.ctx.spec,
                engine.state,
                self._submitted.get(job, 0.0),
                self._scheduling,
                phase=training_phase(
                    engine.version,
                    engine.snapshots.every_rounds,
                    in_round=engine.round_state is not None
                    and engine.round_state.config.round == engine.version,
                    last_snapshot=engine.snapshots.last_round,
                    next_snapshot=engine.snapshots.next_round(engine.version),
                ),
                preempting=engine.preempting is not None,
                claim=self._claims.get(job, ()),
            )
            for job, engine in self._engines.items()
        ]

    def _regions(self) -> list[RegionFacts]:
        views = self._s.control.regions
        facts = []
        for region in self._s.runtime.policies:
            view = views.get(region)
            up = view is not None and view.up
            capacity = view.status.capacity if view is not None and view.up else None
            facts.append(RegionFacts(region, up, capacity))
        return facts

    async def _after_yield(self, job: str) -> None:
        """A preempted job is back in the queue: a pass now, so its status shows its place."""
        self._ledger.stopped(job, self._s.clock())
        try:
            await self._replan(f"job {job} preempted")
        except Exception:  # the job must not fail for it: the next pass tries again
            log.exception("admission pass after preempting %s failed", job)
            self._request_pass(f"job {job} preempted")

    def _request_pass(self, why: str) -> None:
        """Ask the admission task for a pass (from code that must not wait for one)."""
        self._replan_why[why] = None
        self._replan_wanted.set()

    async def _plan_on_request(self) -> None:
        """Run a pass whenever one is asked for (a region changed, a job ended), and every
        ``REPLAN_EVERY_S`` while jobs wait (GPU-hour windows slide, waiting jobs age)."""
        while True:
            timeout = REPLAN_EVERY_S if self._queue else None
            if not await wait_event(self._replan_wanted, timeout):
                self._replan_why["time passed"] = None
            self._replan_wanted.clear()
            why, self._replan_why = "; ".join(self._replan_why), {}
            try:
                await self._replan(why)
            except asyncio.CancelledError:
                raise
            except Exception:  # the next request tries again; the engines go on
                log.exception("admission pass failed")

    async def _replan(self, why: str) -> None:
        """One admission pass: start the queued jobs that fit now, queue the others."""
        async with self._planning:
            facts = self._facts()
            now = self._s.clock()
            intervals = self._ledger.intervals()
            decided = admission_pass(now, self._regions(), facts, self._scheduling, intervals)
            self._show_queue(decided.queue)  # first: the I/O below yields to status readers
            for start in decided.starts:
                engine = self._engines.get(start.job)
                if engine is None or engine.state is not JobState.QUEUED:
                    continue
                reason = f"{start.reason} ({why})"
                try:
                    await self._s.db.run(
                        record_job_start, start.job, self._s.actor, reason, start.regions
                    )
                except ConflictError:
                    continue  # cancelled meanwhile
                engine.set_state(JobState.RUNNING)
                spec = engine.ctx.spec
                gpus = sum(gpus_needed(spec, region) for region in start.regions)
                self._ledger.started(start.job, spec.team_name, gpus, now)
                log.info("job %s started: %s", start.job, reason)
                await self._s.control.event("job.started", job=start.job, detail=reason)
            for job, reason in decided.preempt.items():
                engine = self._engines[job]
                if engine.state is JobState.RUNNING and engine.preempting is None:
                    log.info("job %s to be preempted: %s", job, reason)
                    await engine.preempt(reason)
                    self._s.metrics.preemptions.labels(priority=engine.scheduling.priority).inc()
            self._claims = dict(decided.claims)
        self._count_states()
        self._show_usage(now)

    def _listed(self) -> dict[str, Listed]:
        return {
            job: Listed(
                job,
                engine.state,
                engine.scheduling.priority,
                engine.scheduling.team,
                engine.ctx.spec.needs is not None,
                self._submitted.get(job),
                self.cost_estimate(engine),
            )
            for job, engine in self._engines.items()
        }

    def cost_estimate(self, engine: JobEngine, projected: float | None = None) -> dict[str, Any]:
        """What ``engine``'s job will cost against its budget (``projected``: the
        projection of what it cost so far once there is one; what it cost, once ended)."""
        spec, round_s = engine.ctx.spec, engine.snapshots.stats.round_s
        prices, ended = self._s.config.prices, engine.state.final
        return outlook_json(spec, prices, round_s, projected, ended=ended)

    def _show_queue(self, queue: Mapping[str, QueueEntry]) -> None:
        """Each job's place in the queue (None: not waiting), and the queue per class."""
        self._queue = dict(queue)
        for job, engine in self._engines.items():
            entry = self._queue.get(job)
            engine.scheduling.queue = entry.as_dict() if entry is not None else None
        listed = self._listed().values()
        waiting = waiting_per_priority(listed, self._queue, self._scheduling.priorities)
        for priority, count in waiting.items():
            self._s.metrics.jobs_queued.labels(priority=priority).set(count)

    @property
    def scheduling(self) -> SchedulingConfig:
        """The scheduling file in force (loaded at start)."""
        return self._scheduling

    def refresh_metrics(self) -> None:
        """Bring the usage gauges up to now (waits and GPU-seconds grow between passes);
        the ``/metrics`` handler calls it before each scrape."""
        self._show_usage(self._s.clock())

    def _show_usage(self, now: float) -> None:
        """Capacity held per region and team, GPU-hours per team, the oldest wait per class."""
        metrics, facts = self._s.metrics, self._facts()
        for region in self._s.runtime.policies:
            used = in_use(region, facts)
            for resource in ("gpus", "cpu_slots"):
                metrics.region_capacity_in_use.labels(region=region, resource=resource).set(
                    used[resource]
                )
        # The default team always has its series, so its alerts see 0 rather than nothing.
        teams = {*self._scheduling.teams, DEFAULT_TEAM}
        for team, gpus in gpus_held(facts, teams).items():
            metrics.team_gpus_in_use.labels(team=team).set(gpus)
        hours = team_gpu_hours(self._ledger.intervals(), self._scheduling, now)
        for team, used_h in hours.items():
            metrics.team_gpu_seconds.labels(team=team).set(used_h * 3600)
        windows = [q.window_s for q in self._scheduling.teams.values() if q.window_s]
        # Closed spans older than every window count for nothing (no window: none count).
        self._ledger.forget_before(now - max(windows, default=0.0))
        waits = queue_waits(self._listed(), self._queue, self._scheduling.priorities, teams, now)
        for priority, waited in waits.oldest_s.items():
            metrics.queue_oldest_wait.labels(priority=priority).set(waited)
        for team, count in waits.over_quota.items():
            metrics.team_quota_waiting.labels(team=team).set(count)

    def queue(self) -> list[dict[str, Any]]:
        """The jobs waiting (in queue order) and running, as ``GET /v1/queue`` shows them."""
        return queue_rows(self._listed().values(), self._queue, self._s.clock())

    def region_usage(self, region: str) -> dict[str, Any]:
        """``capacity`` (None: unknown, treated as unlimited) and ``in_use`` of ``region``."""
        view = self._s.control.regions.get(region)
        capacity = view.status.capacity if view is not None and view.up else None
        return {"capacity": capacity_json(capacity), "in_use": in_use(region, self._facts())}
