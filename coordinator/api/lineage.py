"""``GET /v1/jobs/{job}/lineage[?round=N]``: what made θ_N (default: the newest version).

The record is read from the signed manifest of the update that produced θ_N (round
N-1), as stored in the job's checkpoint location
(:func:`coordinator.publication.lineage.read_lineage`),
so what is served is exactly what the coordinator signed; the answer names that
manifest's digest and signer. Operators and observers read it; θ_0 (built from the task,
no round behind it) and versions whose update retention removed answer 404.
"""

from __future__ import annotations

from aiohttp import web

from coordinator.api.admin import int_query, visible_engine
from coordinator.api.auth import READERS, require_role
from coordinator.api.keys import SERVICES
from coordinator.errors import NotFound
from coordinator.publication.lineage import read_lineage
from geofed.api_paths import ApiPaths

__all__ = ["routes"]

routes = web.RouteTableDef()


@routes.get(ApiPaths.LINEAGE)
async def lineage(request: web.Request) -> web.Response:
    identity = require_role(request, *READERS)
    engine = visible_engine(request, identity)
    newest = engine.version
    text = request.query.get("round")
    version = newest if text is None else int_query(text, "round", 0)
    if version > newest:
        raise NotFound(f"θ_{version} of job {engine.job} is not published (θ_{newest} is newest)")
    if version == 0:
        raise NotFound(f"θ_0 of job {engine.job} is the task's initial model: no round made it")
    services = request.app[SERVICES]
    location = engine.ctx.publishing.location
    stored = await services.executors.files(read_lineage, location, engine.job, version)
    if stored is None:
        raise NotFound(
            f"the update that made θ_{version} of job {engine.job} is not in {location.name}"
        )
    if stored.lineage is None:
        raise NotFound(f"the update that made θ_{version} of job {engine.job} has no lineage")
    return web.json_response(
        {
            "job": engine.job,
            "version": version,
            "update_manifest": stored.update_manifest,
            "signed_by": stored.producer,
            "lineage": stored.lineage,
        }
    )
