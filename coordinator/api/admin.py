"""Admin HTTP handlers: health, metrics, jobs, regions, audit.

Thin: parse the request, check the caller's role, call the job manager or the store,
answer JSON. Operators manage jobs; operators and observers read, ``/metrics`` included
(Prometheus scrapes as an observer). A region reads only the jobs it takes part in; to a
region every other job answers exactly as one that does not exist
(:func:`visible_engine`), so neither a metric nor a status code tells it which jobs exist.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from coordinator.api.auth import READERS, caller, require_role, unknown_job
from coordinator.api.bodies import read_limited
from coordinator.api.keys import COSTS, JOBS, REGISTRY, RUNTIME, SERVICES
from coordinator.costs.report import cost_json, expected_cost
from coordinator.costs.watch import CostWatch
from coordinator.errors import ApiError, BadRequest
from coordinator.jobs.status import deltas_json
from coordinator.rounds.engine import JobEngine
from coordinator.scheduling.elastic import RegionChange
from coordinator.state.async_store import AsyncStore
from coordinator.state.store import MAX_STORED_INT
from geofed.api_paths import ApiPaths
from geofed.timeouts import Timeout, wait_for
from geofed.types import Identity, InvalidName, Role, validate_name

__all__ = [
    "audit_page",
    "current_costs",
    "int_query",
    "parse_region_change",
    "refresh_costs",
    "routes",
    "visible_engine",
]

log = logging.getLogger(__name__)
routes = web.RouteTableDef()


@routes.get(ApiPaths.HEALTHZ)
async def healthz(request: web.Request) -> web.Response:
    """The process is alive and serving."""
    return web.json_response({"status": "ok"})


@routes.get(ApiPaths.READYZ)
async def readyz(request: web.Request) -> web.Response:
    """Ready: the state database answers, MQTT is connected, policies are loaded, and the
    state of every job stored before the start was read back (until then a restarted
    coordinator knows none of their rounds)."""
    services = request.app[SERVICES]
    checks: dict[str, Any] = {}
    try:
        await services.db.audit_head()
        checks["database"] = "ok"
    except Exception as exc:  # any failure of the store means not ready
        checks["database"] = f"error: {exc}"
    checks["mqtt"] = "ok" if services.control.connected else "disconnected"
    policies = len(services.runtime.policies)
    checks["policies"] = f"ok ({policies} regions)" if policies else "none loaded"
    # The jobs stored before a start, not one just submitted (θ_0 of a large model may
    # take a while to build, and the coordinator serves meanwhile).
    recovering = request.app[JOBS].recovering()
    checks["jobs"] = f"recovering: {', '.join(recovering)}" if recovering else "ok"
    ready = all(str(value).startswith("ok") for value in checks.values())
    return web.json_response({"ready": ready, "checks": checks}, status=200 if ready else 503)


@routes.get(ApiPaths.METRICS)
async def metrics(request: web.Request) -> web.Response:
    # Job- and region-labelled series of every job: readers only, never a region.
    require_role(request, *READERS)
    request.app[JOBS].refresh_metrics()  # queue waits and GPU-seconds, as of now
    await current_costs(request.app)
    body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def current_costs(app: web.Application) -> CostWatch:
    """The app's cost figures, refreshed as of now within half the request timeout
    (:func:`refresh_costs`): for the scrape, the job statuses and the status page alike."""
    costs = app[COSTS]
    await refresh_costs(costs.refresh, app[SERVICES].config.timeouts.request_s / 2)
    return costs


async def refresh_costs(refresh: Callable[[], Awaitable[object]], timeout_s: float) -> None:
    """The cost gauges as of now (:meth:`CostWatch.refresh`); a refresh that fails or takes
    longer than ``timeout_s`` leaves those of the last one (a scrape is never refused for
    them)."""
    try:
        async with asyncio.timeout(timeout_s):
            await refresh()
    except Exception as exc:  # the figures wait for the next scrape; the scrape goes on
        log.warning("cost gauges not refreshed: %s", str(exc) or type(exc).__name__)


@routes.get(ApiPaths.JOBS)
async def list_jobs(request: web.Request) -> web.Response:
    require_role(request, *READERS)
    jobs = request.app[JOBS]
    body = [engine.status() for engine in jobs.engines()]
    unavailable = [
        {"job": job, "state": "unavailable", "error": reason}
        for job, reason in jobs.unavailable().items()
    ]
    return web.json_response({"jobs": body + unavailable})


@routes.post(ApiPaths.JOBS)
async def submit_job(request: web.Request) -> web.Response:
    actor = require_role(request, Role.OPERATOR)
    config = request.app[RUNTIME].config
    limit = config.limits.max_job_spec_bytes
    try:
        data = await wait_for(
            read_limited(request.content, limit, "job spec", request.content_length),
            config.timeouts.request_s,
            "reading the job spec",
        )
    except Timeout as exc:
        raise ApiError(408, "timeout", str(exc)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"job spec is not UTF-8: {exc}") from None
    overrides = {
        name: request.query[name] for name in ("priority", "team") if name in request.query
    }
    result = await request.app[JOBS].submit(text, actor, overrides)
    return web.json_response(result, status=201)


def visible_engine(request: web.Request, identity: Identity) -> JobEngine:
    """The engine of the path's job, if ``identity`` may see the job.

    Readers see every job (404 unknown, 503 unavailable). Anyone else sees only the jobs
    its region takes part in; every other job (unknown, unavailable, or of other regions)
    answers the same 404 ``not_found`` as a job that does not exist.
    """
    jobs = request.app[JOBS]
    job = request.match_info["job"]
    if identity.role in READERS:
        return jobs.engine(job)
    try:
        engine = jobs.engine(job)
    except ApiError as exc:
        if exc.code == "bad_request":
            raise  # a malformed name: says nothing about which jobs exist
        raise unknown_job(job) from None
    if identity.role is not Role.REGION or identity.name not in engine.ctx.spec.regions:
        raise unknown_job(job)
    return engine


@routes.get(ApiPaths.JOB)
async def job_status(request: web.Request) -> web.Response:
    identity = caller(request)
    engine = visible_engine(request, identity)
    body = engine.status()
    snapshot = body.get("snapshot")
    if identity.role not in READERS and isinstance(snapshot, dict) and snapshot.get("risk"):
        # Its reason names other regions' hardware: a region sees only the score.
        snapshot["risk"] = {"score": snapshot["risk"]["score"], "reason": None}
    if identity.role in READERS:
        body["spec"] = engine.ctx.spec.to_json()
        totals = await request.app[SERVICES].db.receipt_totals(engine.job)
        body["deltas"] = deltas_json(totals)
        costs = await current_costs(request.app)
        cost = costs.latest.get(engine.job)
        expected = None
        if cost is not None:
            ended, rounds = engine.state.final, engine.ctx.spec.rounds
            # A job that ended has no projection: what it cost is what it costs.
            body["cost"] = cost_json(cost, costs.currency, None if ended else rounds)
            expected = expected_cost(cost, rounds, ended=ended)
        body["cost_estimate"] = request.app[JOBS].cost_estimate(engine, expected)
    return web.json_response(body)


@routes.post(ApiPaths.JOB_ACTION)
async def change_job(request: web.Request) -> web.Response:
    actor = require_role(request, Role.OPERATOR)
    result = await request.app[JOBS].change(
        request.match_info["job"], request.match_info["action"], actor
    )
    return web.json_response(result)


@routes.post(ApiPaths.JOB_PREEMPT)
async def preempt_job(request: web.Request) -> web.Response:
    """Stop a job at its next round boundary and requeue it (admins;
    coordinator.scheduling.teams)."""
    actor = require_role(request, Role.OPERATOR)
    result = await request.app[JOBS].preempt(request.match_info["job"], actor)
    return web.json_response(result, status=202)


#: A region change is a line of JSON; anything longer is not one.
MAX_REGION_CHANGE_BYTES = 16 * 1024


@routes.post(ApiPaths.JOB_REGIONS)
async def change_job_regions(request: web.Request) -> web.Response:
    """Add a region to a job (``{"add": R, "datasets": [...]}``) or remove one
    (``{"remove": R}``); it takes effect at the job's next round boundary."""
    actor = require_role(request, Role.OPERATOR)
    jobs = request.app[JOBS]
    jobs.engine(request.match_info["job"])  # 404 before the body of an unknown job is read
    timeout = request.app[RUNTIME].config.timeouts.request_s
    try:
        data = await wait_for(
            read_limited(
                request.content, MAX_REGION_CHANGE_BYTES, "region change", request.content_length
            ),
            timeout,
            "reading the region change",
        )
    except Timeout as exc:
        raise ApiError(408, "timeout", str(exc)) from None
    change = parse_region_change(data)
    result = await jobs.change_regions(request.match_info["job"], change, actor)
    return web.json_response(result, status=202)


def parse_region_change(data: bytes) -> RegionChange:
    """The change a request body asks for; 400 ``bad_request`` naming what is wrong."""
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"region change is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(
            'region change must be an object: {"add": R, "datasets": [...]} or {"remove": R}'
        )
    actions = [key for key in ("add", "remove") if key in body]
    if len(actions) != 1:
        raise BadRequest("region change names exactly one of add, remove")
    action = actions[0]
    unknown = sorted(set(body) - {action, "datasets"} if action == "add" else set(body) - {action})
    if unknown:
        raise BadRequest(f"region change: unknown keys {unknown}")
    region = body[action]
    if not isinstance(region, str):
        raise BadRequest(f"{action}: a region name is a string, not {type(region).__name__}")
    try:
        validate_name("region", region)
    except InvalidName as exc:
        raise BadRequest(f"{action}: {exc}") from None
    datasets: tuple[str, ...] = ()
    if action == "add":
        given = body.get("datasets")
        if not isinstance(given, list) or not given:
            raise BadRequest(f"datasets: name the datasets {region} trains on (a list)")
        if not all(isinstance(name, str) for name in given):
            raise BadRequest("datasets: dataset names are strings")
        try:
            datasets = tuple(validate_name("dataset", name) for name in given)
        except InvalidName as exc:
            raise BadRequest(f"datasets: {exc}") from None
        if len(set(datasets)) != len(datasets):
            raise BadRequest("datasets: a dataset is named twice")
    return RegionChange(action, region, datasets)


@routes.get(ApiPaths.REGIONS)
async def regions(request: web.Request) -> web.Response:
    require_role(request, *READERS)
    services = request.app[SERVICES]
    quarantines = {engine.job: engine.quarantined() for engine in request.app[JOBS].engines()}
    body = []
    for region in services.runtime.policies:
        entry: dict[str, Any] = {
            "region": region,
            "jurisdiction": services.runtime.policies.jurisdiction_of(region),
            "state": "unknown",
            # job -> why this region sits out its rounds
            "quarantined": {
                job: held[region] for job, held in sorted(quarantines.items()) if region in held
            },
            # what the agent offers (null: unknown, treated as unlimited) and what the
            # capacity-scheduled jobs hold of it
            **request.app[JOBS].region_usage(region),
        }
        view = services.control.regions.get(region)
        if view is not None:
            status = view.status
            entry.update(
                state=status.state,
                job=status.job,
                round=status.round,
                params_hash=status.params_hash,
                train_loss=status.train_loss,
                worker_restarts=status.worker_restarts,
                detail=status.detail,
                updated_at=status.sent_at.isoformat(),
                hardware=None if status.hardware is None else status.hardware.model_dump(),
            )
        body.append(entry)
    return web.json_response({"regions": body})


@routes.get(ApiPaths.QUEUE)
async def queue(request: web.Request) -> web.Response:
    """Jobs waiting for capacity (in queue order) and running, with priority and reason."""
    require_role(request, *READERS)
    return web.json_response({"jobs": request.app[JOBS].queue()})


@routes.get(ApiPaths.AUDIT)
async def audit(request: web.Request) -> web.Response:
    require_role(request, *READERS)
    return web.json_response(await audit_page(request.app[SERVICES].db, request.query))


async def audit_page(db: AsyncStore, query: Mapping[str, str]) -> dict[str, Any]:
    """``GET /v1/audit``'s answer: a page of entries after ``after``, the head, a check."""
    after = int_query(query.get("after", "0"), "after", 0)
    limit = int_query(query.get("limit", "100"), "limit", 1, 1000)
    job = query.get("job")
    if job is not None:
        try:
            validate_name("job", job)
        except InvalidName as exc:
            raise BadRequest(str(exc)) from None
    entries = await db.audit_entries(after, limit, job)
    seq, digest = await db.audit_head()
    body: dict[str, Any] = {
        "entries": [entry.to_dict() for entry in entries],
        "head": {"seq": seq, "hash": digest},
    }
    if query.get("verify") in ("1", "true"):
        result = await db.verify_audit()
        body["verify"] = {
            "ok": result.ok,
            "checked": result.checked,
            "first_bad_seq": result.first_bad_seq,
            "reason": result.reason,
        }
    return body


def int_query(text: str, name: str, low: int, high: int | None = MAX_STORED_INT) -> int:
    """An integer from a query or path, ``low..high`` (``high`` None: unbounded), else 400."""
    try:
        value = int(text)
    except ValueError:
        raise BadRequest(f"query parameter {name} must be an integer, got {text!r}") from None
    if value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise BadRequest(f"query parameter {name} must be {bound}, got {value}")
    return value
