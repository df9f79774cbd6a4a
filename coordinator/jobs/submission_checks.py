"""The checks a job passes before it is admitted, and residency's admission of it.

:class:`SubmissionChecks` holds what the job manager asks of a submitted spec before it
records the job: the task module and checkpoint locations this coordinator allows, the
deadline against its timeouts, the priority class and team (who may submit for which
team, at which class), GPUs a team's quota can count, and the policy engine's admission
of the job as placed. A refusal raises the :class:`~coordinator.errors.ApiError` that
explains it; a team's boundary crossed is audited first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from coordinator.errors import BadRequest, Forbidden
from coordinator.jobs.context import JobContextError
from coordinator.jobs.spec import JobSpec
from coordinator.rounds.deadline import DeadlineError
from coordinator.scheduling import SchedulingConfig
from coordinator.scheduling.quota import uncounted_gpus_refusal
from coordinator.scheduling.teams import operator_team, priority_refusal, submission_refusal
from coordinator.services import Services
from coordinator.state.audit import AuditEvent, AuditVerdict
from geofed.task import task_module_refusal
from geofed.types import Identity, InvalidName, validate_name
from policies import Admission, JobPlacement, PlacementError, StorageLocation, admit_job

__all__ = [
    "SubmissionChecks",
    "check_task_module",
    "configured_location",
    "gpus_needed",
    "overridden",
]

log = logging.getLogger(__name__)


class SubmissionChecks:
    """A submitted spec's checks against this coordinator (``scheduling``: its current
    scheduling config)."""

    def __init__(self, services: Services, scheduling: Callable[[], SchedulingConfig]) -> None:
        self._s = services
        self._scheduling = scheduling

    def local(self, spec: JobSpec) -> None:
        """400 for what this coordinator cannot run: a task module it does not allow,
        checkpoint locations it lacks, a deadline past its timeouts, an unknown class."""
        try:
            check_task_module(spec, self._s)
        except JobContextError as exc:
            raise BadRequest(f"task.spec: {exc}") from None
        locations = self._s.runtime.locations
        unknown = [name for name in spec.checkpoint_storage if name not in locations]
        if unknown:
            known = ", ".join(sorted(locations))
            raise BadRequest(
                f"checkpoint_storage names {unknown}, which this coordinator does not "
                f"have; configured: {known}"
            )
        try:
            spec.deadline.check_against(self._s.config.timeouts)
        except DeadlineError as exc:
            raise BadRequest(f"deadline: {exc}") from None
        priorities = self._scheduling().priorities
        if spec.priority is not None and spec.priority not in priorities:
            raise BadRequest(
                f"priority: {spec.priority!r} is not a priority class of this coordinator "
                f"(known: {', '.join(sorted(priorities))})"
            )

    async def team(self, spec: JobSpec, actor: Identity) -> JobSpec:
        """The spec with its team (the submitter's when it names none); 403 ``forbidden``
        (audited) when the submitter may not submit for that team, the team may not use
        the job's priority class, or the job would train on GPUs its quota cannot count."""
        if spec.team is None:
            spec = spec.model_copy(update={"team": operator_team(actor)})
        else:
            await self._refuse(actor, spec, submission_refusal(actor, spec.team, self._admins))
        scheduling = self._scheduling()
        priority = spec.priority or scheduling.default_priority
        allowed = scheduling.team_priorities(spec.team_name)
        await self._refuse(
            actor, spec, priority_refusal(actor, spec.team_name, priority, allowed, self._admins)
        )
        await self._refuse(actor, spec, self.uncounted(spec, spec.regions))
        return spec

    @property
    def _admins(self) -> tuple[str, ...]:
        return self._s.config.admins

    async def _refuse(self, actor: Identity, spec: JobSpec, refusal: str | None) -> None:
        if refusal is not None:
            await self.deny(actor, "job.submit", spec.job, refusal)
            raise Forbidden(refusal)

    def uncounted(self, spec: JobSpec, regions: Iterable[str]) -> str | None:
        """Why ``spec``'s job would train on GPUs of ``regions`` its team's quota cannot
        count (:func:`coordinator.scheduling.quota.uncounted_gpus_refusal`), or None."""
        views = self._s.control.regions
        region_gpus: dict[str, int] = {}
        for region in regions:
            view = views.get(region)
            capacity = view.status.capacity if view is not None else None
            region_gpus[region] = capacity.gpus if capacity is not None else 0
        return uncounted_gpus_refusal(
            spec.team_name,
            self._scheduling(),
            {region: gpus_needed(spec, region) for region in region_gpus},
            region_gpus,
        )

    async def deny(self, actor: Identity, action: str, job: str, reason: str) -> None:
        """Audit a refused request (a team's boundary) before it is answered 403."""
        log.warning("refused %s of job %s by %s: %s", action, job, actor, reason)
        await self._s.db.append_audit(
            AuditEvent(
                actor=actor,
                action=action,
                verdict=AuditVerdict.DENY,
                job=job,
                details={"reason": reason},
            )
        )

    def admit(self, spec: JobSpec) -> Admission:
        """Every region's residency policy on the job as placed (400: it cannot be placed)."""
        runtime = self._s.runtime
        candidates = [
            StorageLocation(
                name, runtime.locations[name].jurisdiction, runtime.locations[name].region
            )
            for name in spec.checkpoint_storage
        ]
        inherited = spec.init_from.provenance if spec.init_from is not None else None
        try:
            placement = JobPlacement.build(
                spec.regions, self._s.config.jurisdiction, candidates, inherited=inherited
            )
        except PlacementError as exc:
            raise BadRequest(f"job placement: {exc}") from None
        admission = admit_job(runtime.policies, placement)
        for decision in admission.decisions:
            self._s.metrics.policy_decision(decision.allowed, "admission")
        return admission

    async def record_refusal(self, spec: JobSpec, admission: Admission, actor: Identity) -> None:
        """Audit a refused admission (an admitted one is recorded with the job itself, in
        one transaction)."""
        if admission.admitted:
            return
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


def gpus_needed(spec: JobSpec, region: str) -> int:
    """The GPUs ``spec``'s job states it needs in ``region`` (0: none stated)."""
    need = spec.need_in(region)
    return 0 if need is None else need.gpus


def overridden(spec: JobSpec, overrides: Mapping[str, str]) -> JobSpec:
    """``spec`` with the submitter's ``priority``/``team`` instead of its own; 400 if bad."""
    unknown = sorted(set(overrides) - {"priority", "team"})
    if unknown:
        raise BadRequest(f"unknown submission overrides {unknown}; use priority or team")
    for name, value in overrides.items():
        try:
            validate_name("priority class" if name == "priority" else "team", value)
        except InvalidName as exc:
            raise BadRequest(f"{name}: {exc}") from None
    return spec.model_copy(update=dict(overrides))


def check_task_module(spec: JobSpec, services: Services) -> None:
    """Refuse a task module the config does not allow, before anything imports it."""
    refusal = task_module_refusal(spec.task.spec, services.config.allowed_task_modules)
    if refusal is not None:
        raise JobContextError(refusal)


def configured_location(location: str | None, services: Services) -> str:
    """``location`` if this coordinator still has it configured; else why not."""
    if location is None or location not in services.runtime.locations:
        raise JobContextError(f"its checkpoint location {location!r} is not configured any more")
    return location
