"""Model exports: an operator takes a job's global model away, as a decided, audited transfer.

``POST /v1/jobs/{job}/exports`` with ``{"destination": "storage:NAME" | "jurisdiction:CODE",
"round": N}`` (round optional: the newest published version) decides the export like
any other transfer of the global model: a ``global_checkpoint`` from the coordinator to
the destination, under the policies of every region that contributed
(:mod:`coordinator.residency`: counted, audited as ``policy.global_checkpoint``). Either
way an ``export`` entry records the outcome in the audit log; a denial answers ``403
policy_denied`` naming the rule. An allowed export answers ``201`` with a grant: the
chain that restores θ_N (a snapshot and the updates after it, each with its digests)
and, per artifact, a URL under ``exports/<id>/artifacts/<sha256>`` that serves it to that
operator only, until the grant expires. The artifacts are the signed bundles the regions
download; the client verifies and rebuilds them (:mod:`geofed.export`).

``jurisdiction:CODE`` names a place no policy declares (the operator's machine, say): it
is decided as an undeclared storage location ``export-<operator>`` in that jurisdiction,
so only rules written for the jurisdiction (or ``*``) can allow it. Neither is the
operator's to choose: a destination is decided only if the coordinator config's
``export_destinations`` grants it to the operator's team (admins may name any); another is
refused ``403 forbidden``, audited. Grants live in the coordinator's memory: after a
restart the operator asks again.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, NoReturn

from aiohttp import web

from coordinator.api.admin import int_query, visible_engine
from coordinator.api.auth import require_role
from coordinator.api.bodies import read_limited
from coordinator.api.file_response import BoundedFile
from coordinator.api.keys import SERVICES
from coordinator.errors import BadRequest, Forbidden, NotFound
from coordinator.residency import policy_denied
from coordinator.rounds.engine import JobEngine
from coordinator.scheduling.teams import destination_refusal, management_refusal
from coordinator.services import Services
from coordinator.state.audit import AuditEvent, AuditVerdict, format_time
from coordinator.storage.artifacts import chain_at
from coordinator.storage.checkpoints import CheckpointEntry
from geofed.api_paths import ApiPaths
from geofed.blobstore import InvalidDigest, validate_digest
from geofed.types import ArtifactKind, Identity, InvalidName, Role, validate_name
from policies import Endpoint, PolicySet, Transfer
from policies.decisions import Decision
from policies.destinations import validate_jurisdiction
from policies.errors import InvalidDestination, UnknownEndpoint

__all__ = ["EXPORTS", "EXPORT_TTL_S", "ExportGrants", "export_destination", "routes", "setup"]

#: How long an export grant serves its artifacts.
EXPORT_TTL_S: Final = 3600.0
_MAX_BODY: Final = 4096

routes = web.RouteTableDef()


@dataclass(frozen=True, slots=True)
class AllowedExport:
    """What one allowed export may fetch, by whom, until when."""

    holder: str  # SPIFFE URI
    job: str
    digests: frozenset[str]
    expires_at: float


class ExportGrants:
    """The unexpired export grants, in memory; expired ones are dropped as new ones come."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._grants: dict[str, AllowedExport] = {}

    def add(self, holder: Identity, job: str, digests: frozenset[str]) -> tuple[str, AllowedExport]:
        now = self._clock()
        self._grants = {k: g for k, g in self._grants.items() if g.expires_at > now}
        grant = AllowedExport(holder.uri, job, digests, now + EXPORT_TTL_S)
        key = secrets.token_hex(16)
        self._grants[key] = grant
        return key, grant

    def allows(self, key: str, holder: Identity, job: str, digest: str) -> bool:
        grant = self._grants.get(key)
        return (
            grant is not None
            and grant.expires_at > self._clock()
            and grant.holder == holder.uri
            and grant.job == job
            and digest in grant.digests
        )


EXPORTS: Final = web.AppKey("exports", ExportGrants)


def setup(app: web.Application) -> None:
    """Add the export routes and their grant table to the coordinator app."""
    app[EXPORTS] = ExportGrants()
    app.add_routes(routes)


def export_destination(
    policies: PolicySet, text: object, operator: Identity, coordinator_jurisdiction: str
) -> Endpoint:
    """The endpoint an export to ``text`` goes to; :class:`BadRequest` if it names nothing."""
    if not isinstance(text, str):
        raise BadRequest("destination must be storage:NAME or jurisdiction:CODE")
    kind, sep, value = text.partition(":")
    try:
        if sep and kind == "storage":
            return policies.endpoint(text, coordinator_jurisdiction)
        if sep and kind == "jurisdiction":
            name = validate_name("storage", f"export-{operator.name}")
            return Endpoint.of_storage(name, validate_jurisdiction(value))
    except (InvalidDestination, UnknownEndpoint, InvalidName) as exc:
        raise BadRequest(f"export destination {text!r}: {exc}") from None
    raise BadRequest(f"export destination {text!r}: use storage:NAME or jurisdiction:CODE")


@routes.post(ApiPaths.EXPORTS)
async def create_export(request: web.Request) -> web.Response:
    identity = require_role(request, Role.OPERATOR)
    engine = visible_engine(request, identity)
    body = await _json_body(request)
    services = request.app[SERVICES]
    ctx = engine.ctx
    config = services.config
    # A job's model follows its team's rights, as pausing it does: not any operator's.
    refusal = management_refusal(identity, "export", engine.job, ctx.spec.team_name, config.admins)
    if refusal is not None:
        await _refuse(services, identity, engine.job, refusal)
    version = engine.version
    requested = body.get("round")
    round_ = version if requested is None else int_query(str(requested), "round", 0)
    if round_ > version:
        raise NotFound(f"θ_{round_} of job {engine.job} is not published (θ_{version} is newest)")
    named = body.get("destination")
    destination = export_destination(
        services.runtime.policies, named, identity, config.jurisdiction
    )
    # Where the model lands is granted to the team, not declared by its operator.
    assert isinstance(named, str)  # export_destination refused anything else
    refusal = destination_refusal(identity, named, config.export_destinations, config.admins)
    if refusal is not None:
        await _refuse(services, identity, engine.job, refusal, destination=named)
    transfer = Transfer(
        ArtifactKind.GLOBAL_CHECKPOINT,
        ctx.coordinator_endpoint(),
        destination,
        ctx.provenance(),
    )
    decision = await services.residency.decide(
        transfer, actor=identity, job=engine.job, round=round_
    )
    location = ctx.publishing.location
    chain = None
    if decision.allowed:
        chain = await services.executors.files(chain_at, location, engine.job, round_)
    details: dict[str, Any] = {
        "destination": destination.describe(),
        "rule": decision.rule.rule_id,
        "reason": decision.reason,
        "location": location.name,
    }
    grant_key = None
    if chain is not None:
        snapshot, updates = chain
        digests = frozenset(entry.payload_digest for entry in (snapshot, *updates))
        grant_key, grant = request.app[EXPORTS].add(identity, engine.job, digests)
        details.update(export=grant_key, expires_at=format_time(grant.expires_at))
    elif decision.allowed:
        details["error"] = f"no restorable chain of θ_{round_} in {location.name}"
    await services.db.append_audit(
        AuditEvent(
            actor=identity,
            action="export",
            verdict=AuditVerdict.ALLOW if decision.allowed else AuditVerdict.DENY,
            job=engine.job,
            round=round_,
            details=details,
        )
    )
    if not decision.allowed:
        raise policy_denied(decision, f"exporting job {engine.job}'s model to {destination}")
    if chain is None or grant_key is None:
        raise NotFound(details["error"])
    return _granted(engine, round_, grant_key, chain, destination, decision, details)


def _granted(
    engine: JobEngine,
    round_: int,
    grant_key: str,
    chain: tuple[CheckpointEntry, list[CheckpointEntry]],
    destination: Endpoint,
    decision: Decision,
    details: dict[str, Any],
) -> web.Response:
    """The 201 answer to a granted export: where to fetch each part of θ_round's chain."""
    snapshot, updates = chain
    working = engine.working
    published = working.params_hash if working is not None and working.version == round_ else None

    def part(entry: CheckpointEntry) -> dict[str, Any]:
        return {
            "round": entry.round,
            "url": ApiPaths.export_artifact(engine.job, grant_key, entry.payload_digest),
            "payload_digest": entry.payload_digest,
            "manifest_digest": entry.manifest_digest,
        }

    return web.json_response(
        {
            "export": grant_key,
            "job": engine.job,
            "round": round_,
            "parameters_hash": published,
            "destination": str(destination),
            "rule": decision.rule.rule_id,
            "expires_at": details["expires_at"],
            "snapshot": part(snapshot),
            "updates": [part(update) for update in updates],
            # What θ is the model of: an export in the model's own format needs it.
            "task": {
                "spec": engine.ctx.spec.task.spec,
                "options": dict(engine.ctx.spec.task.options),
            },
        },
        status=201,
    )


@routes.get(ApiPaths.EXPORT_ARTIFACT)
async def export_artifact(request: web.Request) -> web.StreamResponse:
    identity = require_role(request, Role.OPERATOR)
    engine = visible_engine(request, identity)
    try:
        digest = validate_digest(request.match_info["digest"])
    except InvalidDigest as exc:
        raise BadRequest(str(exc)) from None
    key = request.match_info["export"]
    if not request.app[EXPORTS].allows(key, identity, engine.job, digest):
        raise NotFound(f"export {key} of job {engine.job} grants {identity} no artifact {digest}")
    services = request.app[SERVICES]
    path = engine.ctx.publishing.location.path_of(digest)
    # Prepared by aiohttp, within download_s (a client that stops reading is let go).
    return BoundedFile(
        path,
        services.config.timeouts.download_s,
        headers={"Content-Type": "application/octet-stream"},
    )


async def _refuse(
    services: Services, identity: Identity, job: str, reason: str, **details: str
) -> NoReturn:
    """Audit a refused export and answer 403 with ``reason``."""
    await services.db.append_audit(
        AuditEvent(
            actor=identity,
            action="export",
            verdict=AuditVerdict.DENY,
            job=job,
            details={"reason": reason, **details},
        )
    )
    raise Forbidden(reason)


async def _json_body(request: web.Request) -> dict[str, Any]:
    raw = await read_limited(request.content, _MAX_BODY, "export request", request.content_length)
    try:
        body = json.loads(raw or b"{}")
    except ValueError as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body
