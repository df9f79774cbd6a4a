"""The coordinator's aiohttp application: factory, middlewares, routes, lifecycle.

:func:`create_app` builds the app from a loaded :class:`~coordinator.runtime.Runtime`.
Everything long-lived starts in one ``cleanup_ctx`` and stops in reverse order when the
app is cleaned up (SIGTERM): engines are cancelled between steps (a publication already
computing finishes in its thread and is simply not committed, so the restarted
coordinator recomputes it), the MQTT client disconnects, the thread pools finish what
they are running, and the state database closes.

Middlewares, outermost first: JSON errors; then either TLS identity (client
certificate verified against the trust bundle, identity header refused) or, in insecure
loopback mode, the identity header. Serve it with
:class:`~coordinator.api.server.CoordinatorRunner`, which answers what aiohttp's HTTP
parser refuses in the same JSON form.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CollectorRegistry

from coordinator.api import admin as api_admin
from coordinator.api import data as api_data
from coordinator.api import export as api_export
from coordinator.api import lineage as api_lineage
from coordinator.api import usage as api_usage
from coordinator.api.auth import header_identity_middleware, refuse_identity_header_middleware
from coordinator.api.cross_site import cross_site_refusal
from coordinator.api.keys import COSTS, JOBS, REGISTRY, RUNTIME, SERVICES, UPLOADS
from coordinator.api.server import error_code
from coordinator.api.ui import handler as status_page
from coordinator.control import ControlPlane
from coordinator.costs.watch import CostWatch
from coordinator.errors import ApiError, Forbidden
from coordinator.executors import Executors
from coordinator.ha.lease import Fence
from coordinator.intake.uploads import UploadService
from coordinator.jobs.manager import JobManager
from coordinator.metrics import CoordinatorMetrics
from coordinator.runtime import Runtime
from coordinator.services import Services
from coordinator.state.async_store import AsyncStore
from coordinator.state.audit import AuditEvent, AuditVerdict
from coordinator.state.backends import open_state_store
from geofed.pki.httpauth import PEER_IDENTITY, RefusalHook, identity_middleware

__all__ = [
    "INSECURE_BANNER",
    "create_app",
    "cross_site_middleware",
    "error_middleware",
    "identity_middlewares",
]

log = logging.getLogger(__name__)

INSECURE_BANNER = (
    "INSECURE LOOPBACK MODE: plain HTTP without client certificates; callers are whoever "
    "their X-Geofed-Identity header claims. For the single-machine demo only."
)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error as ``{"error": CODE, "message": TEXT}``."""
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response(exc.body(), status=exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.json_response(
            {"error": error_code(exc.status), "message": exc.reason}, status=exc.status
        )
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return web.json_response(
            {"error": "internal", "message": "internal error; see the coordinator's log"},
            status=500,
        )


@web.middleware
async def cross_site_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse, 403 ``cross_site`` and audited, a mutating request another site's page may
    have made a browser send (:func:`coordinator.api.cross_site.cross_site_refusal`)."""
    reason = cross_site_refusal(request.method, request.headers, request.scheme, request.host)
    if reason is None:
        return await handler(request)
    actor = request.get(PEER_IDENTITY) or f"unverified peer {request.remote}"
    log.warning("refused %s %s from %s: %s", request.method, request.path, actor, reason)
    services = request.app.get(SERVICES)
    if services is not None:
        await services.db.append_audit(
            AuditEvent(
                actor=actor,
                action="request.cross_site",
                verdict=AuditVerdict.DENY,
                details={"method": request.method, "path": request.path, "reason": reason},
            )
        )
    raise Forbidden(f"refused {reason}", "cross_site")


def identity_middlewares(
    runtime: Runtime, on_refused: RefusalHook | None = None
) -> list[Middleware]:
    """Who calls: the client certificate (TLS), or the header in insecure loopback mode.

    ``on_refused``: what else to do about a refused certificate (it is always logged).
    """
    config = runtime.config
    if config.tls_enabled:
        return [
            refuse_identity_header_middleware(),
            identity_middleware(runtime.trust, on_refused=on_refused),
        ]
    log.warning(INSECURE_BANNER)
    return [header_identity_middleware(config.federation)]


def create_app(
    runtime: Runtime,
    *,
    registry: CollectorRegistry,
    clock: Callable[[], float] = time.time,
    fence: Fence | None = None,
) -> web.Application:
    """The coordinator app for ``runtime``; serve it with ``runtime.server_ssl()``.

    ``fence``: the leader lease this coordinator holds, when several share the state.
    """
    config = runtime.config
    limits = config.limits
    app = web.Application(
        middlewares=[
            error_middleware,
            *identity_middlewares(runtime, api_data.refused_peer),
            cross_site_middleware,
        ],
        client_max_size=max(limits.max_manifest_bytes, limits.max_job_spec_bytes) + 4096,
        # A connection without a complete request (unfinished headers included) for
        # request_s is closed, so no client holds one open for long.
        handler_args={"keepalive_timeout": config.timeouts.request_s},
    )
    app[RUNTIME] = runtime
    app[REGISTRY] = registry
    app.cleanup_ctx.append(_lifecycle(clock, fence))
    app.add_routes(api_admin.routes)
    app.add_routes(api_data.routes)
    api_export.setup(app)
    app.add_routes(api_lineage.routes)
    app.add_routes(api_usage.routes)
    status_page.install(app)
    return app


def _lifecycle(
    clock: Callable[[], float], fence: Fence | None
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        runtime = app[RUNTIME]
        config = runtime.config
        executors = Executors(evaluation_max_bytes=config.limits.max_task_bytes)
        metrics = CoordinatorMetrics(app[REGISTRY])
        for name, timestamp in runtime.certificate_expiry().items():
            metrics.certificate_expiry.labels(certificate=name).set(timestamp)
        db = await AsyncStore.open(
            lambda: open_state_store(config.state_store, config.state_dir, fence), executors
        )
        control = ControlPlane(config, runtime.mqtt_ssl(), metrics, frozenset(runtime.policies))
        await control.start()
        mqtt = asyncio.create_task(control.client.run(), name="mqtt")
        services = Services(runtime, db, executors, control, metrics, clock)
        jobs = JobManager(services)
        app[SERVICES] = services
        app[JOBS] = jobs
        app[UPLOADS] = UploadService(services, jobs)
        app[COSTS] = CostWatch(services, lambda: jobs.scheduling.teams)
        try:
            await jobs.start()
            # What start-up built lives as long as the process: frozen, the collector's
            # full passes skip it, so a burst of allocation (a hostile body being parsed in
            # a thread) never stalls the loop for a pass over torch's and the app's objects.
            gc.collect()
            gc.freeze()
            yield
        finally:
            gc.unfreeze()
            await jobs.stop()
            await control.close()
            if not mqtt.done():
                mqtt.cancel()
            await asyncio.wait([mqtt])
            if not mqtt.cancelled() and mqtt.exception() is not None:
                log.error("MQTT client ended with an error: %s", mqtt.exception())
            await db.close()
            await asyncio.to_thread(executors.shutdown)
            log.info("coordinator stopped")

    return lifecycle
