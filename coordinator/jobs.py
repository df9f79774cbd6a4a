"""Jobs: submission with residency admission, pause, resume, cancel, and their engines.

Submission parses the spec off the event loop (file:line:key errors), checks it against
this coordinator (task modules it allows, before anything is imported; storage locations
it knows; deadlines against its timeouts), asks the policy engine whether every region's
policy admits the job as placed (a refusal names the rule), loads
the task, records the job with the checkpoint location admission allows (the first
allowed candidate, in the spec's order), audits the admission, and starts the job's
:class:`~coordinator.engine.JobEngine`. The manager owns every engine task and cancels
them on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Any, Literal

from coordinator.audit import AuditEvent, AuditVerdict
from coordinator.context import JobContext, JobContextError, build_context
from coordinator.deadline import DeadlineError
from coordinator.engine import JobEngine
from coordinator.errors import ApiError, BadRequest, Conflict, NotFound
from coordinator.jobspec import JobSpec, JobSpecError, parse_job_spec, parse_stored_spec
from coordinator.records import JobState
from coordinator.services import Services
from coordinator.store import AlreadyExists, ConflictError
from coordinator.transactions import LOCATION_POINTER, record_admitted_job, record_job_change
from geofed.task import task_module_refusal
from geofed.types import Identity, InvalidName, validate_name
from policies import Admission, JobPlacement, PlacementError, StorageLocation, admit_job

__all__ = ["JobManager"]

log = logging.getLogger(__name__)
Action = Literal["pause", "resume", "cancel"]

#: action -> (states it applies to, resulting state, command sent to the job's regions)
_TRANSITIONS: dict[str, tuple[frozenset[JobState], JobState, Action]] = {
    "pause": (frozenset({JobState.RUNNING}), JobState.PAUSED, "pause"),
    "resume": (frozenset({JobState.PAUSED}), JobState.RUNNING, "resume"),
    "cancel": (frozenset({JobState.RUNNING, JobState.PAUSED}), JobState.CANCELLED, "cancel"),
}


class JobManager:
    """Every job of this coordinator and the task of each engine."""

    def __init__(self, services: Services) -> None:
        self._s = services
        self._engines: dict[str, JobEngine] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._unavailable: dict[str, str] = {}
        self._submitting = asyncio.Lock()

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Rebuild and start the engine of every stored job."""
        records = await self._s.db.list_jobs()
        for record in records:
            try:
                spec = parse_stored_spec(record.spec)
                _check_task_module(spec, self._s)
                location = await self._s.db.get_pointer(record.job_id, LOCATION_POINTER)
                ctx = await self._s.executors.compute(
                    build_context, spec, self._s.runtime, _configured(location, self._s)
                )
            except (JobSpecError, JobContextError) as exc:
                self._unavailable[record.job_id] = str(exc)
                log.error("job %s cannot be resumed: %s", record.job_id, exc)  # noqa: TRY400
                continue
            self._launch(ctx, JobState(record.state))
        self._count_states()

    async def stop(self) -> None:
        """Cancel every engine and wait for them."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _launch(self, ctx: JobContext, state: JobState) -> JobEngine:
        engine = JobEngine(self._s, ctx, state)
        self._engines[ctx.job] = engine
        task = asyncio.create_task(self._run(engine), name=f"job-{ctx.job}")
        self._tasks[ctx.job] = task
        return engine

    async def _run(self, engine: JobEngine) -> None:
        await engine.run()
        self._count_states()

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

    def _count_states(self) -> None:
        counts = dict.fromkeys((state.value for state in JobState), 0)
        for engine in self._engines.values():
            counts[engine.state.value] += 1
        for state, count in counts.items():
            self._s.metrics.jobs.labels(state=state).set(count)

    # -- submission -----------------------------------------------------------------

    async def submit(self, text: str, actor: Identity) -> dict[str, Any]:
        """Admit and start a job; raise the ApiError that explains a refusal."""
        try:
            # Bounded, but a hostile body is slow to parse: never on the event loop.
            spec = await self._s.executors.parse(parse_job_spec, text, "request")
        except JobSpecError as exc:
            raise BadRequest(
                f"invalid job spec: {exc}", extra={"problems": list(exc.problems)}
            ) from None
        self._check_local(spec)
        async with self._submitting:
            if spec.job in self._engines or spec.job in self._unavailable:
                raise Conflict(f"job {spec.job} already exists", "already_exists")
            admission = self._admit(spec)
            await self._record_admission(spec, admission, actor)
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
            try:
                await self._s.db.run(
                    record_admitted_job,
                    spec.job,
                    spec.to_json(),
                    location,
                    actor,
                    len(admission.decisions),
                )
            except AlreadyExists:
                raise Conflict(f"job {spec.job} already exists", "already_exists") from None
            engine = self._launch(ctx, JobState.RUNNING)
        with contextlib.suppress(TimeoutError):
            # θ_0 and round 0 are usually ready in well under a second; answer then.
            await asyncio.wait_for(engine.ready.wait(), self._s.config.timeouts.request_s)
        self._count_states()
        log.info("job %s admitted; checkpoints in %s", spec.job, location)
        await self._s.control.event("job.admitted", job=spec.job, detail=f"by {actor}")
        return {
            "job": spec.job,
            "state": engine.state.value,
            "checkpoint_location": location,
            "decisions": len(admission.decisions),
        }

    def _check_local(self, spec: JobSpec) -> None:
        try:
            _check_task_module(spec, self._s)
        except JobContextError as exc:
            raise BadRequest(f"task.spec: {exc}") from None
        unknown = [
            name for name in spec.checkpoint_storage if name not in self._s.runtime.locations
        ]
        if unknown:
            known = ", ".join(sorted(self._s.runtime.locations))
            raise BadRequest(
                f"checkpoint_storage names {unknown}, which this coordinator does not "
                f"have; configured: {known}"
            )
        try:
            spec.deadline.check_against(self._s.config.timeouts)
        except DeadlineError as exc:
            raise BadRequest(f"deadline: {exc}") from None

    def _admit(self, spec: JobSpec) -> Admission:
        runtime = self._s.runtime
        candidates = [
            StorageLocation(
                name, runtime.locations[name].jurisdiction, runtime.locations[name].region
            )
            for name in spec.checkpoint_storage
        ]
        try:
            placement = JobPlacement.build(spec.regions, self._s.config.jurisdiction, candidates)
        except PlacementError as exc:
            raise BadRequest(f"job placement: {exc}") from None
        admission = admit_job(runtime.policies, placement)
        for decision in admission.decisions:
            self._s.metrics.policy_decision(decision.allowed, "admission")
        return admission

    async def _record_admission(self, spec: JobSpec, admission: Admission, actor: Identity) -> None:
        if admission.admitted:
            return  # recorded with the job itself, in one transaction
        await self._s.db.append_audit(
            AuditEvent(
                actor=actor,
                action="job.admit",
                verdict=AuditVerdict.DENY,
                job=spec.job,
                details={
                    "denials": [d.as_dict() for d in admission.denials],
                    "decisions": [d.as_dict() for d in admission.decisions],
                },
            )
        )

    # -- pause, resume, cancel ---------------------------------------------------------

    async def change(self, job: str, action: str, actor: Identity) -> dict[str, Any]:
        """Pause, resume or cancel ``job``; 409 ``invalid_state`` when it does not apply."""
        engine = self.engine(job)
        if action not in _TRANSITIONS:
            raise BadRequest(f"unknown job action {action!r}; use pause, resume or cancel")
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
        self._count_states()
        for region in engine.ctx.spec.region_names:
            await self._s.control.command(region, command, job, f"{action} by {actor}")
        return {"job": job, "state": target.value}


def _check_task_module(spec: JobSpec, services: Services) -> None:
    """Refuse a task module the config does not allow, before anything imports it."""
    refusal = task_module_refusal(spec.task.spec, services.config.allowed_task_modules)
    if refusal is not None:
        raise JobContextError(refusal)


def _configured(location: str | None, services: Services) -> str:
    if location is None or location not in services.runtime.locations:
        raise JobContextError(f"its checkpoint location {location!r} is not configured any more")
    return location
