"""Federation identity on aiohttp servers and clients.

Server side: :func:`identity_middleware` verifies the client certificate of every request
(grants, revocation, federation; OpenSSL already checked the chain during the handshake),
stores the :class:`~geofed.types.Identity` under :data:`PEER_IDENTITY`, and answers a
refused peer with ``403 {"error": CODE, "message": TEXT}`` (after an optional hook that
lets the server count or audit the refusal).

Client side: :class:`VerifiedConnector` is a ``TCPConnector`` that checks the server's
certificate the same way, and against the identity the caller expects, after the
handshake and before any byte of the request is sent. A refusal raises the
:class:`~geofed.pki.errors.CertificateRefused` subclass out of the session call (it is
not an ``aiohttp.ClientError``: a retry loop should not retry a refused identity).

Both take the bundle as a value or as a zero-argument callable, so a daemon that reloads
its trust bundle (new revocations) has them honoured on live connections. The callable
runs once per request, so it should return a cached bundle, not read the file.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, Final

import aiohttp
from aiohttp import web
from aiohttp.connector import Connection
from aiohttp.tracing import Trace
from aiohttp.typedefs import Handler, Middleware

from geofed.pki.bundle_source import BundleSource, current
from geofed.pki.errors import CertificateRefused, NoPeerCertificate, UnexpectedPeer
from geofed.pki.tls import Clock, peer_identity, utc_now
from geofed.types import Identity, Role

logger = logging.getLogger(__name__)

PEER_IDENTITY: Final = web.RequestKey("geofed_peer_identity", Identity)
"""Where :func:`identity_middleware` puts the verified identity of the request's peer."""

RefusalHook = Callable[[web.Request, CertificateRefused], Awaitable[None]]


def identity_middleware(
    bundle: BundleSource, *, clock: Clock = utc_now, on_refused: RefusalHook | None = None
) -> Middleware:
    """An aiohttp middleware admitting only requests from accepted federation identities.

    ``on_refused`` runs for every refused request before it is answered.
    """

    @web.middleware
    async def verify_peer(request: web.Request, handler: Handler) -> web.StreamResponse:
        transport = request.transport
        ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
        try:
            identity = peer_identity(ssl_object, current(bundle), now=clock())
        except CertificateRefused as err:
            logger.warning(
                "refused %s %s from %s: %s",
                request.method,
                request.path,
                request.remote,
                err,
                extra={"refusal": err.code},
            )
            if on_refused is not None:
                await on_refused(request, err)
            return web.json_response({"error": err.code, "message": str(err)}, status=403)
        request[PEER_IDENTITY] = identity
        return await handler(request)

    return verify_peer


def expectation_met(identity: Identity, expect: Identity | Role | None) -> bool:
    """Whether ``identity`` is the expected one: exact identity, any of a role, or anyone."""
    if expect is None:
        return True
    if isinstance(expect, Role):
        return identity.role is expect
    return identity == expect


class VerifiedConnector(aiohttp.TCPConnector):
    """A connector that talks only to a TLS server with an accepted, expected identity.

    ``expect`` is the exact server identity, a role every acceptable server holds
    (default: a coordinator), or ``None`` for any identity the bundle accepts.
    """

    def __init__(
        self,
        bundle: BundleSource,
        ssl_context: ssl.SSLContext,
        *,
        expect: Identity | Role | None = Role.COORDINATOR,
        clock: Clock = utc_now,
        **kwargs: Any,
    ) -> None:
        super().__init__(ssl=ssl_context, **kwargs)
        self._bundle = bundle
        self._expect = expect
        self._clock = clock

    # The signature is TCPConnector.connect's, timeout included.
    async def connect(
        self,
        req: aiohttp.ClientRequest,
        traces: list[Trace],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109
    ) -> Connection:
        conn = await super().connect(req, traces, timeout)
        try:
            self._check(conn, req)
        except CertificateRefused:
            conn.close()
            raise
        return conn

    def _check(self, conn: Connection, req: aiohttp.ClientRequest) -> None:
        transport = conn.transport
        if not req.is_ssl() or transport is None:
            raise NoPeerCertificate(f"{req.url.origin()} is not a TLS server")
        identity = peer_identity(
            transport.get_extra_info("ssl_object"), current(self._bundle), now=self._clock()
        )
        if not expectation_met(identity, self._expect):
            raise UnexpectedPeer(f"{req.url.origin()} is {identity}, expected {self._expect}")
