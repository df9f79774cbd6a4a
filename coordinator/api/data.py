"""Data-plane HTTP handlers: delta uploads (three steps and single shot) and downloads.

Downloads go only to regions of the job (to any other region the job answers as unknown,
``404 not_found``), and each is a residency decision: every
artifact a region fetches (an update, or a checkpoint snapshot to resync from) carries
the global model to that region, so it is decided as a ``global_update`` to it, counted
and audited. Files are served with HTTP ``Range`` support so a download resumes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import web

from coordinator.api.admin import int_query, visible_engine
from coordinator.api.auth import caller
from coordinator.api.file_response import BoundedFile
from coordinator.api.keys import SERVICES, UPLOADS
from coordinator.errors import ApiError, BadRequest, Forbidden, NotFound
from coordinator.residency import region_download
from coordinator.rounds.engine import JobEngine
from coordinator.storage.artifacts import chain_at, find_entry
from coordinator.storage.checkpoints import CheckpointEntry, EntryKind
from geofed.api_paths import ApiPaths
from geofed.blobstore import InvalidDigest, validate_digest
from geofed.pki.errors import CertificateRefused
from geofed.types import Identity, InvalidName, Role, validate_name

__all__ = ["refused_peer", "routes"]

routes = web.RouteTableDef()

_UPLOAD_STEPS = {
    ("PUT", ApiPaths.DELTA_MANIFEST): "manifest",
    ("PUT", ApiPaths.DELTA_CHUNK): "chunk",
    ("POST", ApiPaths.DELTA_COMMIT): "commit",
    ("PUT", ApiPaths.DELTA): "bundle",
}


def _names(request: web.Request) -> tuple[str, int, str]:
    info = request.match_info
    try:
        job = validate_name("job", info["job"])
        region = validate_name("region", info["region"])
    except InvalidName as exc:
        raise BadRequest(str(exc)) from None
    # Unbounded here: a round no job has is refused by the round check, counted and
    # audited like any other refused upload.
    return job, int_query(info["round"], "round", 0, high=None), region


@routes.put(ApiPaths.DELTA_MANIFEST)
async def put_manifest(request: web.Request) -> web.Response:
    job, round_, region = _names(request)
    uploads = request.app[UPLOADS]
    result = await uploads.put_manifest(
        job, round_, region, caller(request), request.content, request.content_length
    )
    return web.json_response(result)


@routes.put(ApiPaths.DELTA_CHUNK)
async def put_chunk(request: web.Request) -> web.Response:
    job, round_, region = _names(request)
    try:
        index = int(request.match_info["index"])
    except ValueError:
        raise BadRequest("frame index must be an integer", "bad_chunk_index") from None
    uploads = request.app[UPLOADS]
    result = await uploads.put_chunk(job, round_, region, index, caller(request), request.content)
    return web.json_response(result)


@routes.post(ApiPaths.DELTA_COMMIT)
async def commit(request: web.Request) -> web.Response:
    job, round_, region = _names(request)
    uploads = request.app[UPLOADS]
    result = await uploads.commit(
        job, round_, region, caller(request), request.content, request.content_length
    )
    return web.json_response(result)


@routes.put(ApiPaths.DELTA)
async def single_shot(request: web.Request) -> web.Response:
    job, round_, region = _names(request)
    uploads = request.app[UPLOADS]
    result = await uploads.single_shot(job, round_, region, caller(request), request.content)
    return web.json_response(result)


async def refused_peer(request: web.Request, error: CertificateRefused) -> None:
    """Count and audit a delta upload whose client certificate was refused (revoked, ...).

    The TLS identity check answers before any handler runs; without this, an upload with
    a revoked certificate would leave no trace in the refusal counter and the audit log.
    """
    resource = request.match_info.route.resource
    step = None if resource is None else _UPLOAD_STEPS.get((request.method, resource.canonical))
    if step is None:
        return
    try:
        job, round_, region = _names(request)
    except ApiError:
        return
    await request.app[UPLOADS].refused_peer(job, round_, region, step, error, request.remote)


@routes.get(ApiPaths.UPDATE)
async def get_update(request: web.Request) -> web.StreamResponse:
    engine, identity = _download_access(request)
    round_ = int_query(request.match_info["round"], "round", 0)
    if round_ >= engine.version:
        raise NotFound(
            f"update {round_} of job {engine.job} is not published "
            f"(round {engine.version} is current)"
        )
    services = request.app[SERVICES]
    location = engine.ctx.publishing.location
    entry = await services.executors.files(
        find_entry, location, engine.job, EntryKind.UPDATE, round_
    )
    if entry is None:
        raise NotFound(f"update {round_} of job {engine.job} is not stored in {location.name}")
    return await _serve(request, engine, identity, entry, round_)


@routes.get(ApiPaths.LATEST_CHECKPOINT)
async def latest_checkpoint(request: web.Request) -> web.Response:
    engine, _ = _download_access(request)
    working = engine.working
    if working is None:
        raise NotFound(f"job {engine.job} has no parameters yet")
    services = request.app[SERVICES]
    location = engine.ctx.publishing.location
    chain = await services.executors.files(chain_at, location, engine.job, working.version)
    if chain is None:
        raise NotFound(f"job {engine.job} has no restorable checkpoint in {location.name}")
    snapshot, updates = chain

    def part(entry: CheckpointEntry) -> dict[str, Any]:
        return {
            "round": entry.round,
            "url": ApiPaths.artifact(engine.job, entry.payload_digest),
            "manifest_digest": entry.manifest_digest,
        }

    return web.json_response(
        {
            "job": engine.job,
            "round": working.version,
            "parameters_hash": working.params_hash,
            "location": location.name,
            "snapshot": part(snapshot),
            "updates": [part(update) for update in updates],
        }
    )


@routes.get(ApiPaths.ARTIFACT)
async def get_artifact(request: web.Request) -> web.StreamResponse:
    engine, identity = _download_access(request)
    try:
        digest = validate_digest(request.match_info["digest"])
    except InvalidDigest as exc:
        raise BadRequest(str(exc)) from None
    services = request.app[SERVICES]
    location = engine.ctx.publishing.location
    entries = await services.executors.files(location.store.entries, engine.job)
    entry = next((e for e in entries if e.payload_digest == digest), None)
    if entry is None:
        raise NotFound(f"job {engine.job} has no artifact {digest}")
    return await _serve(request, engine, identity, entry, entry.round)


def _download_access(request: web.Request) -> tuple[JobEngine, Identity]:
    identity = caller(request)
    # A region not in the job gets the 404 of a job that does not exist.
    engine = visible_engine(request, identity)
    if identity.role is not Role.REGION:
        raise Forbidden(
            f"{identity} may not download artifacts of job {engine.job}; its regions may"
        )
    return engine, identity


def _size_of(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


async def _serve(
    request: web.Request, engine: JobEngine, identity: Identity, entry: CheckpointEntry, round_: int
) -> web.StreamResponse:
    services = request.app[SERVICES]
    ctx = engine.ctx
    path = ctx.publishing.location.path_of(entry.payload_digest)
    size = await asyncio.to_thread(_size_of, path)
    await services.residency.enforce(
        region_download(ctx, identity.name),
        what=f"sending this artifact to {identity.name}",
        actor=identity,
        job=engine.job,
        round=round_,
        region=identity.name,
        # What is sent, for usage reports (coordinator.costs): a resumed download counts
        # the whole artifact again.
        details={"artifact": entry.kind.value, "size": size},  # None: not there (404 below)
    )
    update = entry.kind is EntryKind.UPDATE
    kind = "global_update" if update else "global_checkpoint"
    # A streaming round's update carries its fragment only; a snapshot all of θ.
    fp32 = ctx.round_fp32_bytes(round_) if update else ctx.fp32_bytes

    def sent(status: int, size: int) -> None:
        services.metrics.sent_bytes.labels(kind=kind).inc(size)
        if status == 200:
            services.metrics.fp32_equivalent_bytes.labels(direction="sent").inc(fp32)

    return BoundedFile(
        path,
        services.config.timeouts.download_s,
        headers={"Content-Type": "application/octet-stream"},
        on_sent=sent,
    )
