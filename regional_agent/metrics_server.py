"""The agent's operations listener: ``/metrics`` and ``/healthz`` over mutual TLS.

Prometheus scrapes ``GET /metrics`` (text format 0.0.4) with an observer certificate
(``deploy/prometheus/prometheus.yml``, port 9443). The listener presents the region's
own identity certificate and requires a client certificate from the federation's trust
bundle in every mode, the insecure-loopback demo included: the agent holds certificates
anyway, and its numbers are the region's ``metrics`` artifact. After the handshake,
:func:`geofed.pki.httpauth.identity_middleware` checks grants, revocation and the
federation (403 otherwise); then:

- ``/metrics``: observers, operators and coordinators; anyone else (a region, this one
  included) gets 403 ``forbidden``;
- ``/healthz``: any verified identity of the federation (a probe on the host may use the
  agent's own certificate); 200 ``{"status": "ok", ...}`` while the event loop serves.

Before each scrape ``refresh()`` brings the values read from live state (the MQTT
connection, the worker group's restart count) up to date; if it fails or takes longer
than its bound, the scrape still answers, with the values of the last refresh.
Errors are JSON ``{"error": CODE, "message": TEXT}``, as the coordinator answers them.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from geofed.pki import TrustBundle, server_ssl_context
from geofed.pki.httpauth import PEER_IDENTITY, identity_middleware
from geofed.pki.tls import Clock, utc_now
from geofed.timeouts import wait_for
from geofed.types import Role
from regional_agent.config import MetricsConfig
from regional_agent.credentials import Credentials

__all__ = [
    "READERS",
    "MetricsServer",
    "MetricsServerError",
    "create_metrics_app",
    "metrics_server",
]

log = logging.getLogger(__name__)

#: Roles that may read ``/metrics``.
READERS: Final = frozenset({Role.OBSERVER, Role.OPERATOR, Role.COORDINATOR})
#: How long in-flight scrapes may finish when the listener closes.
_SHUTDOWN_S = 2.0

Refresh = Callable[[], Awaitable[None]]
Health = Callable[[], Mapping[str, str]]


class MetricsServerError(Exception):
    """The listener could not start; the message names the address and the reason."""


@dataclass(frozen=True)
class _Sources:
    registry: CollectorRegistry
    refresh: Refresh | None
    health: Health | None
    refresh_timeout_s: float


_SOURCES: Final = web.AppKey("geofed_agent_metrics_sources", _Sources)


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": code, "message": message}, status=status)


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {403: "forbidden", 404: "not_found"}.get(exc.status, "bad_request")
        return _error(exc.status, code, exc.reason)


async def _metrics(request: web.Request) -> web.Response:
    identity = request[PEER_IDENTITY]
    if identity.role not in READERS:
        allowed = ", ".join(sorted(role.value for role in READERS))
        return _error(403, "forbidden", f"{identity} may not read /metrics; roles {allowed} may")
    sources = request.app[_SOURCES]
    if sources.refresh is not None:
        try:
            await wait_for(sources.refresh(), sources.refresh_timeout_s, "metrics refresh")
        except Exception as exc:  # a scrape with older values beats no scrape
            log.warning("serving metrics without a refresh: %s", exc)
    body = generate_latest(sources.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _healthz(request: web.Request) -> web.Response:
    health = request.app[_SOURCES].health
    return web.json_response({"status": "ok", **(health() if health is not None else {})})


def create_metrics_app(
    registry: CollectorRegistry,
    bundle: TrustBundle | Callable[[], TrustBundle],
    *,
    refresh: Refresh | None = None,
    health: Health | None = None,
    refresh_timeout_s: float = 5.0,
    clock: Clock = utc_now,
) -> web.Application:
    """The ``/metrics`` and ``/healthz`` app; serve it with a client-certificate TLS context."""
    if not refresh_timeout_s > 0:
        raise ValueError(f"refresh_timeout_s must be positive, got {refresh_timeout_s!r}")
    app = web.Application(middlewares=[_json_errors, identity_middleware(bundle, clock=clock)])
    app[_SOURCES] = _Sources(registry, refresh, health, refresh_timeout_s)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    return app


class MetricsServer:
    """Serves an app on ``host:port`` with TLS until closed (an async context manager)."""

    def __init__(
        self, app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext
    ) -> None:
        if ssl_context.verify_mode is not ssl.CERT_REQUIRED:
            raise ValueError("the metrics listener requires client certificates")
        self._runner = web.AppRunner(
            app, handle_signals=False, access_log=None, shutdown_timeout=_SHUTDOWN_S
        )
        self._host = host
        self._port = port
        self._ssl = ssl_context
        self._bound: int | None = None

    @property
    def port(self) -> int:
        """The bound port (the configured one, or the one picked for port 0)."""
        if self._bound is None:
            raise RuntimeError("the metrics listener is not started")
        return self._bound

    @property
    def url(self) -> str:
        """``https://host:port/metrics`` of the started listener."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"https://{host}:{self.port}/metrics"

    async def start(self) -> None:
        """Bind and serve; :class:`MetricsServerError` if the address cannot be bound."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port, ssl_context=self._ssl)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise MetricsServerError(
                f"cannot listen on {self._host}:{self._port} for /metrics: {exc.strerror or exc}"
            ) from exc
        self._bound = self._port
        for address in self._runner.addresses:
            if isinstance(address, tuple) and len(address) >= 2:
                self._bound = int(address[1])
                break
        log.info("serving metrics on %s", self.url)

    async def close(self) -> None:
        """Stop listening; in-flight scrapes get a short while to finish."""
        await self._runner.cleanup()

    async def __aenter__(self) -> MetricsServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


def metrics_server(
    config: MetricsConfig,
    credentials: Credentials,
    registry: CollectorRegistry,
    *,
    refresh: Refresh | None = None,
    health: Health | None = None,
) -> MetricsServer:
    """The agent's listener as ``config`` places it, with the region's certificate."""
    context = server_ssl_context(credentials.bundle, credentials.cert_file, credentials.key_file)
    app = create_metrics_app(registry, credentials.trust, refresh=refresh, health=health)
    return MetricsServer(app, config.host, config.port, context)
