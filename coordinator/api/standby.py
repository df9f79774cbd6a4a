"""What a standby coordinator serves while it waits for the leader lease: reads.

A standby (``state_store.leader_lease``, :mod:`coordinator.ha.leadership`) listens on its
configured address with the leader's TLS and client-certificate identity middlewares
(:func:`coordinator.api.app.identity_middlewares`) and answers:

- ``GET /healthz`` 200, and ``GET /readyz`` 503 saying it stands by and who leads, so a
  load balancer's health check sends traffic only to the leader;
- ``GET /metrics`` to readers, as the leader's: ``geofed_coordinator_leader 0`` and
  ``geofed_coordinator_standby_info{leader=HOLDER} 1``
  (:class:`~coordinator.metrics.StandbyMetrics`), so that Prometheus, scraping each
  coordinator's own address, sees a healthy standby up and can alert when none leads;
- ``GET /v1/jobs``, ``GET /v1/jobs/{job}`` and ``GET /v1/audit``, by the leader's role
  rules, from the shared state store, each job marked ``"served_by": "standby"``: its
  record, state, round, θ hash and the current round's record; what only the leader's
  memory holds (its last error, scheduling) is absent;
- everything else 503 ``{"error": "standby", ...}`` naming the leader, so a client
  retries on the leader.

Its store is PostgreSQL opened read-only and without a fence (the server refuses any
write; the schema is checked, never migrated), on first use and again after a failure;
its calls run in the store thread (:class:`~coordinator.state.async_store.AsyncStore`).
:func:`standing_by` serves this app while the daemon waits, and stops it (closing the
store) before the full app binds the same address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

from aiohttp import hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

from coordinator.api.admin import audit_page
from coordinator.api.app import error_middleware, identity_middlewares
from coordinator.api.auth import READERS, caller, require_role, unknown_job
from coordinator.api.server import CoordinatorRunner
from coordinator.errors import BadRequest, Unavailable
from coordinator.executors import Executors
from coordinator.jobs.regions import effective_spec, membership_of
from coordinator.jobs.spec import JobSpec, parse_stored_spec
from coordinator.jobs.status import deltas_json, job_status
from coordinator.metrics import StandbyMetrics
from coordinator.publication.evaluation import (
    METRICS_POINTER,
    VAL_HISTORY_POINTER,
    VAL_LOSS_POINTER,
    parse_history,
    parse_metrics,
    parse_val_loss,
)
from coordinator.rounds.quarantine import QuarantineConfig
from coordinator.rounds.records import JobState, RoundRecord
from coordinator.runtime import Runtime
from coordinator.scheduling.elastic import Membership
from coordinator.state.async_store import AsyncStore
from coordinator.state.store import (
    DeltaTotals,
    JobRecord,
    Store,
    StoredRound,
    StoreError,
    StoreFailure,
)
from coordinator.state.transactions import LOCATION_POINTER
from coordinator.storage.working_state import PARAMS_HASH, VERSION
from geofed.api_paths import ApiPaths
from geofed.sdnotify import Notifier, run_watchdog
from geofed.types import Identity, InvalidName, Role, validate_name

__all__ = [
    "SERVED_BY",
    "LeaderView",
    "StoredJob",
    "create_standby_app",
    "job_view",
    "may_see",
    "read_job",
    "read_jobs",
    "readiness",
    "refusal",
    "standing_by",
]

log = logging.getLogger(__name__)

#: The marker of every job a standby shows.
SERVED_BY: Final = {"served_by": "standby"}
#: How long a stopping standby waits for reads in flight before the leader's app binds.
SHUTDOWN_S: Final = 2.0


class LeaderView(Protocol):
    """Who leads, as the standby last saw it (:class:`~coordinator.ha.leadership.Leadership`)."""

    @property
    def leader(self) -> str: ...

    @property
    def standby_reason(self) -> str: ...


# -- pure shaping -----------------------------------------------------------------


def refusal(leader: str, reason: str, detail: str = "") -> dict[str, Any]:
    """The 503 body of anything a standby does not serve (or cannot read now)."""
    said = f"this coordinator stands by{f' ({detail})' if detail else ''}; "
    return {
        "error": "standby",
        "message": f"{said}the leader is {leader or 'not known yet'} ({reason}); "
        "send it to the leader",
        "leader": leader or None,
    }


def readiness(leader: str, reason: str) -> dict[str, Any]:
    """``GET /readyz``'s 503 body: not ready, standing by, and who leads."""
    return {
        "ready": False,
        "checks": {"leader_lease": f"standby: {reason}"},
        "leader": leader or None,
        **SERVED_BY,
    }


def may_see(identity: Identity, regions: Mapping[str, Any]) -> bool:
    """The leader's rule: readers see every job, a region only the jobs it takes part in."""
    if identity.role in READERS:
        return True
    return identity.role is Role.REGION and identity.name in regions


@dataclass(frozen=True)
class StoredJob:
    """What the state store knows of one job: its record, pointers and current round."""

    record: JobRecord
    pointers: Mapping[str, str]
    current: StoredRound | None


def current_spec(submitted: JobSpec, pointers: Mapping[str, str]) -> JobSpec:
    """The spec as the leader shows it: as submitted until a region joins or leaves,
    then on the regions it runs on now."""
    membership = membership_of(submitted, pointers)
    if membership == Membership.initial(submitted.regions, submitted.region_slots):
        return submitted
    return effective_spec(submitted, membership)


def job_view(
    facts: StoredJob, quarantine: QuarantineConfig, now: float, *, with_spec: bool
) -> dict[str, Any]:
    """The job as the leader's ``GET /v1/jobs/{job}`` shows it, from the store alone.

    Raises ``ValueError`` (a damaged record, a stored spec that no longer parses).
    """
    record, pointers = facts.record, facts.pointers
    spec = current_spec(parse_stored_spec(record.spec), pointers)
    state = JobState(record.state)
    version = int(pointers.get(VERSION, "0"))
    current = (
        RoundRecord.from_dict(facts.current.state, quarantine)
        if facts.current is not None
        else None
    )
    val_loss = pointers.get(VAL_LOSS_POINTER)
    history = pointers.get(VAL_HISTORY_POINTER)
    metrics = pointers.get(METRICS_POINTER)
    quarantined: dict[str, str] = {}
    if current is not None and not state.final:
        verdicts = (current.quarantine.status(r, version, now) for r in spec.region_names)
        quarantined = {v.region: v.reason for v in verdicts if v.quarantined}
    body = job_status(
        job=record.job_id,
        state=state,
        version=version,
        rounds=spec.rounds,
        regions=spec.regions,
        params_hash=pointers.get(PARAMS_HASH),
        location=pointers.get(LOCATION_POINTER, ""),
        val_loss=parse_val_loss(val_loss) if val_loss else None,
        val_history=parse_history(history) if history else {},
        error="",
        quarantined=quarantined,
        record=current,
        evaluation=parse_metrics(metrics) if metrics else None,
    )
    body["updated_at"] = record.updated_at
    if with_spec:
        body["spec"] = spec.to_json()
    return {**body, **SERVED_BY}


def unavailable_view(job: str, reason: str) -> dict[str, Any]:
    """A job whose stored facts do not make a view (the leader lists such jobs alike)."""
    return {"job": job, "state": "unavailable", "error": reason, **SERVED_BY}


#: What a damaged record raises while being shaped (the spec, round and quarantine
#: errors are ``ValueError``\ s).
DAMAGED: Final = (ValueError, ValidationError)


# -- reads, in the store thread ---------------------------------------------------------


def read_job(store: Store, job: str) -> StoredJob | None:
    """One job's facts (None: no such job); blocking."""
    record = store.get_job(job)
    if record is None:
        return None
    pointers = store.list_pointers(job)
    try:
        version = int(pointers.get(VERSION, "0"))
    except ValueError:
        version = 0  # shaping the view reports the damaged pointer
    return StoredJob(record, pointers, store.load_round(job, version))


def read_receipt_totals(store: Store, job: str) -> dict[str, DeltaTotals]:
    """What the job's accepted deltas add up to, per region; blocking."""
    return store.receipt_totals(job)


def read_jobs(store: Store) -> list[StoredJob]:
    """Every job's facts, in the store's order; blocking."""
    found = (read_job(store, record.job_id) for record in store.list_jobs())
    return [facts for facts in found if facts is not None]


# -- the app ----------------------------------------------------------------------------


class _Reads:
    """The read-only store: opened on first use, and again after it failed."""

    def __init__(self, opener: Callable[[], Store], executors: Executors) -> None:
        self._opener = opener
        self._executors = executors
        self._db: AsyncStore | None = None
        self._lock = asyncio.Lock()

    async def db(self) -> AsyncStore:
        async with self._lock:
            if self._db is None:
                self._db = await AsyncStore.open(self._opener, self._executors)
            return self._db

    async def failed(self) -> None:
        """Drop a store whose call failed (a lost connection): the next read reopens."""
        async with self._lock:
            db, self._db = self._db, None
        if db is not None:
            with contextlib.suppress(StoreError):
                await db.close()

    async def close(self) -> None:
        await self.failed()
        await asyncio.to_thread(self._executors.shutdown)


@dataclass(frozen=True)
class _Standby:
    """What the handlers need: the config, who leads, the reads, the clock, the metrics."""

    runtime: Runtime
    lease: LeaderView
    reads: _Reads
    clock: Callable[[], float]
    metrics: StandbyMetrics


_STANDBY: Final = web.AppKey("geofed_standby", _Standby)
T = TypeVar("T")

routes = web.RouteTableDef()


def _refused(request: web.Request, detail: str = "") -> web.Response:
    lease = request.app[_STANDBY].lease
    return web.json_response(refusal(lease.leader, lease.standby_reason, detail), status=503)


@routes.get(ApiPaths.HEALTHZ)
async def healthz(request: web.Request) -> web.Response:
    """The process is alive (and stands by)."""
    return web.json_response({"status": "ok", **SERVED_BY})


@routes.get(ApiPaths.READYZ)
async def readyz(request: web.Request) -> web.Response:
    lease = request.app[_STANDBY].lease
    return web.json_response(readiness(lease.leader, lease.standby_reason), status=503)


@routes.get(ApiPaths.METRICS)
async def metrics(request: web.Request) -> web.Response:
    """That this coordinator stands by, and whom it sees leading; readers only, as there."""
    require_role(request, *READERS)
    standby = request.app[_STANDBY]
    standby.metrics.saw(standby.lease.leader)
    body = generate_latest(standby.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _read(request: web.Request, fn: Callable[..., T], *args: str) -> T:
    """``fn(store, *args)`` in the store thread; a store failure drops the store."""
    reads = request.app[_STANDBY].reads
    db = await reads.db()
    try:
        return await db.run(fn, *args)
    except StoreFailure:
        await reads.failed()
        raise


def _view(request: web.Request, facts: StoredJob, *, with_spec: bool) -> dict[str, Any]:
    """The job's view; a damaged one as the leader lists an unavailable job."""
    standby = request.app[_STANDBY]
    quarantine, now = standby.runtime.config.quarantine, standby.clock()
    try:
        return job_view(facts, quarantine, now, with_spec=with_spec)
    except DAMAGED as exc:
        return unavailable_view(facts.record.job_id, f"cannot show the stored job: {exc}")


@routes.get(ApiPaths.JOBS)
async def list_jobs(request: web.Request) -> web.Response:
    require_role(request, *READERS)
    found = await _read(request, read_jobs)
    return web.json_response({"jobs": [_view(request, f, with_spec=False) for f in found]})


@routes.get(ApiPaths.JOB)
async def job_status_handler(request: web.Request) -> web.Response:
    identity = caller(request)
    job = request.match_info["job"]
    try:
        validate_name("job", job)
    except InvalidName as exc:
        raise BadRequest(str(exc)) from None  # as the leader: it says nothing of jobs
    facts = await _read(request, read_job, job)
    if facts is None:
        raise unknown_job(job)
    readers = identity.role in READERS
    if not readers:
        try:
            submitted = parse_stored_spec(facts.record.spec)
            regions = membership_of(submitted, facts.pointers).member_datasets()
        except DAMAGED:
            raise unknown_job(job) from None
        if not may_see(identity, regions):
            raise unknown_job(job)
    body = _view(request, facts, with_spec=readers)
    if body["state"] == "unavailable":  # as the leader answers: a region learns nothing
        raise Unavailable(body["error"]) if readers else unknown_job(job)
    if readers:  # as the leader shows them, from the durable receipts
        body["deltas"] = deltas_json(await _read(request, read_receipt_totals, job))
    return web.json_response(body)


@routes.get(ApiPaths.AUDIT)
async def audit(request: web.Request) -> web.Response:
    require_role(request, *READERS)
    reads = request.app[_STANDBY].reads
    try:
        body = await audit_page(await reads.db(), request.query)
    except StoreFailure:
        await reads.failed()
        raise
    return web.json_response({**body, **SERVED_BY})


async def _refuse(request: web.Request) -> web.Response:
    caller(request)  # only a verified caller learns who leads
    return _refused(request)


@web.middleware
async def _store_trouble(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    """A read the store cannot answer now: 503 ``standby``, so the client asks the leader."""
    try:
        response: web.StreamResponse = await handler(request)
    except StoreError as exc:
        log.warning("standby: %s %s: %s", request.method, request.path, exc)
        return _refused(request, f"and cannot read the state now: {exc}")
    return response


def create_standby_app(
    runtime: Runtime,
    lease: LeaderView,
    *,
    opener: Callable[[], Store] | None = None,
    clock: Callable[[], float] = time.time,
) -> web.Application:
    """The standby's app; serve it with ``runtime.server_ssl()``.

    ``opener``: the read-only store (default: the configured PostgreSQL, read-only).
    """
    config = runtime.config
    app = web.Application(
        middlewares=[error_middleware, *identity_middlewares(runtime), _store_trouble],
        handler_args={"keepalive_timeout": config.timeouts.request_s},
    )
    reads = _Reads(opener or _postgres_reader(runtime), Executors(compute_threads=1))
    app[_STANDBY] = _Standby(runtime, lease, reads, clock, StandbyMetrics(CollectorRegistry()))

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await reads.close()

    app.cleanup_ctx.append(lifecycle)
    app.on_response_prepare.append(_close_after)
    app.add_routes(routes)
    app.router.add_route("*", "/{tail:.*}", _refuse)
    return app


async def _close_after(request: web.Request, response: web.StreamResponse) -> None:
    """Every standby answer closes its connection.

    When the standby starts leading, the full app takes over the address; a client (a
    load balancer's health check, say) must not go on talking to the standby's app over a
    kept-alive connection, which would answer 503 ``standby`` until it idled out. A
    connection accepted just before the switch and still in its TLS handshake is not
    among those the standby's server closes, so closing after every answer is what
    guarantees the next request reaches the app that serves the address now.
    """
    # The hook runs after the headers are made: say it too, or the client reuses it.
    response.force_close()
    response.headers[hdrs.CONNECTION] = "close"


def _postgres_reader(runtime: Runtime) -> Callable[[], Store]:
    dsn = runtime.config.state_store.dsn
    if dsn is None:  # a leader lease needs a dsn (the config refuses otherwise)
        raise ValueError("a standby needs state_store.dsn")

    def open_reader() -> Store:
        from coordinator.state.postgres import PostgresStore  # needs the optional psycopg

        # Short bounds: a read in flight when the lease comes delays the takeover.
        return PostgresStore(dsn, read_only=True, connect_timeout_s=5.0, statement_timeout_s=5.0)

    return open_reader


@asynccontextmanager
async def standing_by(
    runtime: Runtime, lease: LeaderView, notifier: Notifier, watchdog_s: float | None
) -> AsyncIterator[None]:
    """Serve the standby's app on the configured address until the block ends."""
    config = runtime.config
    runner = CoordinatorRunner(
        create_standby_app(runtime, lease), access_log=None, shutdown_timeout=SHUTDOWN_S
    )
    await runner.setup()
    watchdog = None
    try:
        site = web.TCPSite(
            runner, config.listen.host, config.listen.port, ssl_context=runtime.server_ssl()
        )
        await site.start()
        log.info(
            "standby: serving reads on %s:%d until leading", config.listen.host, config.listen.port
        )
        if watchdog_s is not None:
            # A standby's loop turns too: systemd's watchdog must not restart it.
            watchdog = asyncio.create_task(run_watchdog(notifier, watchdog_s), name="watchdog")
        yield
    finally:
        if watchdog is not None:
            watchdog.cancel()
            await asyncio.wait([watchdog])
        await runner.cleanup()
