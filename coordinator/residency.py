"""The coordinator's residency gate: every transfer it accepts or makes is decided once.

Three transfers cross a residency boundary at the coordinator: a region's delta arriving
(:func:`delta_upload`), a global artifact leaving for a region (:func:`region_download`)
and checkpoints going to the job's storage location (:func:`checkpoint_storage`).
:class:`ResidencyGate` decides each with :func:`policies.decide_transfer`, counts it in
``geofed_policy_decisions_total`` and appends it to the audit log. The HTTP handlers
call :meth:`~ResidencyGate.enforce` (a denial answers ``403 policy_denied`` naming the
rule); the round engine calls :meth:`~ResidencyGate.decide` and fails the job on a denial.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coordinator.errors import ApiError
from coordinator.intake.delta_checks import delta_provenance
from coordinator.jobs.context import JobContext
from coordinator.metrics import CoordinatorMetrics
from coordinator.state.async_store import AsyncStore
from coordinator.state.audit import AuditEvent, AuditVerdict
from geofed.manifest import SignedManifest
from geofed.types import ArtifactKind, Identity
from policies import Decision, PolicySet, Transfer, decide_transfer

__all__ = [
    "ResidencyGate",
    "checkpoint_storage",
    "delta_upload",
    "policy_denied",
    "region_download",
]


def delta_upload(ctx: JobContext, region: str, signed: SignedManifest) -> Transfer:
    """A region's model delta arriving at the coordinator, derived from what it declares."""
    return Transfer(
        ArtifactKind.MODEL_DELTA,
        ctx.region_endpoint(region),
        ctx.coordinator_endpoint(),
        delta_provenance(signed),
    )


def region_download(ctx: JobContext, region: str) -> Transfer:
    """A global artifact (update or checkpoint) going to a region: the global model moves."""
    return Transfer(
        ArtifactKind.GLOBAL_UPDATE,
        ctx.coordinator_endpoint(),
        ctx.region_endpoint(region),
        ctx.provenance(),
    )


def checkpoint_storage(ctx: JobContext) -> Transfer:
    """The job's checkpoints going to its storage location."""
    return Transfer(
        ArtifactKind.GLOBAL_CHECKPOINT,
        ctx.coordinator_endpoint(),
        ctx.storage_endpoint(),
        ctx.provenance(),
    )


def policy_denied(decision: Decision, what: str) -> ApiError:
    """The 403 answering a denied transfer of ``what``; it names the deciding rule."""
    rule = decision.rule
    return ApiError(
        403,
        "policy_denied",
        f"residency policy refuses {what}: {decision.reason} "
        f"[rule {rule.rule_id} at {rule.origin}]",
        {"rule": rule.rule_id, "origin": rule.origin},
    )


class ResidencyGate:
    """Decides transfers under the loaded policies; counts and audits every decision."""

    def __init__(self, policies: PolicySet, db: AsyncStore, metrics: CoordinatorMetrics) -> None:
        self._policies = policies
        self._db = db
        self._metrics = metrics

    async def decide(
        self,
        transfer: Transfer,
        *,
        actor: Identity | str,
        job: str,
        round: int | None = None,
        region: str | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> Decision:
        """Decide ``transfer``, count it and audit it (``policy.<kind>``, with ``details``
        about what moves besides the decision's); return the decision."""
        decision = decide_transfer(self._policies, transfer)
        kind = transfer.kind.value
        self._metrics.policy_decision(decision.allowed, kind)
        await self._db.append_audit(
            AuditEvent(
                actor=actor,
                action=f"policy.{kind}",
                verdict=AuditVerdict.ALLOW if decision.allowed else AuditVerdict.DENY,
                job=job,
                round=round,
                region=region,
                details={**(details or {}), **decision.as_dict()},
            )
        )
        return decision

    async def enforce(
        self,
        transfer: Transfer,
        *,
        what: str,
        actor: Identity | str,
        job: str,
        round: int | None = None,
        region: str | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> Decision:
        """:meth:`decide`, then refuse a denial: raise :func:`policy_denied` for ``what``."""
        decision = await self.decide(
            transfer, actor=actor, job=job, round=round, region=region, details=details
        )
        if not decision.allowed:
            raise policy_denied(decision, what)
        return decision
