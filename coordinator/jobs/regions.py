"""An elastic job's regions in the store, and the spec and context they give the job.

The spec is stored as submitted; what changed since is one pointer per region that
joined or left (``member.<region>``): ``{"slot": N, "datasets": [...]}`` while it takes
part, ``{"slot": null, ...}`` once it left (its data still counts for residency). The
job's :class:`~coordinator.scheduling.elastic.Membership` is the submitted regions with
these applied, so it survives a coordinator restart. :func:`record_region_change`
commits the pointer together with the audit entry of the change.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from coordinator.jobs.context import JobContext, with_inherited
from coordinator.jobs.spec import JobSpec
from coordinator.scheduling.elastic import Membership
from coordinator.state.audit import AuditEvent, AuditVerdict
from coordinator.state.store import Store
from geofed.manifest import ArtifactProvenance
from geofed.types import Identity
from policies import PolicySet

__all__ = [
    "MEMBER_POINTER",
    "effective_spec",
    "membership_of",
    "record_region_change",
    "with_membership",
]

#: Pointers of the regions that joined or left a job: ``member.<region>``.
MEMBER_POINTER = "member."


class MembershipError(ValueError):
    """A stored membership pointer is unreadable."""


def membership_of(spec: JobSpec, pointers: Mapping[str, str]) -> Membership:
    """The job's regions now: the submitted ones, with the stored joins and leaves."""
    membership = Membership.initial(spec.regions, spec.region_slots)
    assignment = dict(membership.assignment)
    datasets = dict(membership.datasets)
    for name, value in sorted(pointers.items()):
        if not name.startswith(MEMBER_POINTER):
            continue
        region = name.removeprefix(MEMBER_POINTER)
        try:
            data = json.loads(value)
            slot, sets = data["slot"], tuple(str(d) for d in data["datasets"])
        except (ValueError, KeyError, TypeError) as exc:
            raise MembershipError(f"pointer {name} is not a region membership: {exc}") from None
        datasets[region] = sets
        if slot is None:
            assignment.pop(region, None)
        else:
            assignment[region] = int(slot)
    try:
        return Membership(spec.region_slots, assignment, datasets)
    except ValueError as exc:
        raise MembershipError(f"stored regions of job {spec.job}: {exc}") from None


def effective_spec(spec: JobSpec, membership: Membership) -> JobSpec:
    """``spec`` running on ``membership``'s regions; the quorum and the shard count stay
    what the submitted spec gives (``min_regions`` defaults to the regions submitted)."""
    return spec.model_copy(
        update={
            "regions": membership.member_datasets(),
            "min_regions": spec.quorum,
            "max_regions": spec.region_slots,
        }
    )


def with_membership(
    ctx: JobContext, spec: JobSpec, membership: Membership, policies: PolicySet
) -> JobContext:
    """``ctx`` (built from the submitted ``spec``) for the job on ``membership``'s regions:
    every contributor, departed ones too, stays in the provenance of what it publishes."""
    contributors = with_inherited(spec, membership.datasets)
    jurisdictions = {region: policies.jurisdiction_of(region) or "" for region in contributors}
    provenance = tuple(
        ArtifactProvenance(
            region=region,
            jurisdiction=jurisdictions[region] or "unknown",
            datasets=tuple(sorted(contributors[region])),
        )
        for region in sorted(contributors)
    )
    return dataclasses.replace(
        ctx,
        spec=effective_spec(spec, membership),
        jurisdictions={r: j for r, j in jurisdictions.items() if j},
        publishing=dataclasses.replace(ctx.publishing, provenance=provenance),
        contributors=contributors,
    )


def record_region_change(
    store: Store,
    job: str,
    region: str,
    membership: Membership,
    actor: Identity,
    details: Mapping[str, Any],
) -> None:
    """Store ``region``'s place in ``membership`` (the job after the change) and audit
    the change (``job.regions``, allow) in one transaction."""
    slot = membership.assignment.get(region)
    value = json.dumps(
        {"slot": slot, "datasets": list(membership.datasets[region])}, separators=(",", ":")
    )
    with store.transaction():
        store.set_pointer(job, MEMBER_POINTER + region, value)
        store.append_audit(
            AuditEvent(
                actor=actor,
                action="job.regions",
                verdict=AuditVerdict.ALLOW,
                job=job,
                region=region,
                details=dict(details),
            )
        )
