"""Who is calling, and what their role lets them do.

With TLS (the default) the caller is the SPIFFE identity of its client certificate,
verified by :func:`geofed.pki.httpauth.identity_middleware`; a request that also carries
``X-Geofed-Identity`` is refused, so a header can never pass for a certificate.

In insecure loopback mode (the single-machine demo) there is no certificate, and the
identity comes from the ``X-Geofed-Identity`` header: anyone on the machine can claim
anything. The daemon says so loudly when it starts.

Roles: operators manage jobs; regions upload their own deltas and download what their
jobs publish; observers read status, regions, audit and metrics; the coordinator role
is granted nothing. A job a caller may not see is answered as :func:`unknown_job`, the
answer of a job that does not exist, so its existence does not leak.
"""

from __future__ import annotations

import logging
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from coordinator.errors import Forbidden, NotFound
from geofed.pki.httpauth import PEER_IDENTITY
from geofed.types import Identity, InvalidName, Role

__all__ = [
    "IDENTITY_HEADER",
    "caller",
    "header_identity_middleware",
    "refuse_identity_header_middleware",
    "require_region",
    "require_role",
    "unknown_job",
]

log = logging.getLogger(__name__)

IDENTITY_HEADER: Final = "X-Geofed-Identity"
READERS: Final = frozenset({Role.OPERATOR, Role.OBSERVER})


def caller(request: web.Request) -> Identity:
    """The verified identity of the request's caller (set by the identity middleware)."""
    try:
        return request[PEER_IDENTITY]
    except KeyError:
        raise Forbidden("the request carries no verified identity") from None


def require_role(request: web.Request, *roles: Role) -> Identity:
    """The caller, if it holds one of ``roles``; else 403 ``forbidden``."""
    identity = caller(request)
    if identity.role not in roles:
        allowed = ", ".join(sorted(role.value for role in roles))
        raise Forbidden(f"{identity} may not {request.method} {request.path}; role {allowed} may")
    return identity


def require_region(request: web.Request, region: str) -> Identity:
    """The caller, if it is exactly ``region/<region>``; else 403 ``forbidden``."""
    identity = caller(request)
    if identity.role is not Role.REGION or identity.name != region:
        raise Forbidden(f"{identity} may not act for region {region}; only region/{region} may")
    return identity


def unknown_job(job: str) -> NotFound:
    """The 404 of a job that does not exist; also what a caller gets for a job it may not see."""
    return NotFound(f"no job {job}")


def header_identity_middleware(federation: str) -> Middleware:
    """Insecure loopback mode: take the caller's identity from ``X-Geofed-Identity``."""

    @web.middleware
    async def from_header(request: web.Request, handler: Handler) -> web.StreamResponse:
        value = request.headers.get(IDENTITY_HEADER)
        if value is None:
            return _refuse(f"insecure loopback mode: send {IDENTITY_HEADER}: spiffe://...")
        try:
            identity = Identity.parse(value)
        except InvalidName as exc:
            return _refuse(f"{IDENTITY_HEADER}: {exc}")
        if identity.federation != federation:
            return _refuse(f"{identity} is not of federation {federation!r}")
        request[PEER_IDENTITY] = identity
        return await handler(request)

    return from_header


def refuse_identity_header_middleware() -> Middleware:
    """TLS mode: a request claiming an identity by header is refused, loudly."""

    @web.middleware
    async def refuse_header(request: web.Request, handler: Handler) -> web.StreamResponse:
        if IDENTITY_HEADER in request.headers:
            log.warning(
                "refused %s %s from %s: %s is accepted only in insecure loopback mode",
                request.method,
                request.path,
                request.remote,
                IDENTITY_HEADER,
            )
            return _refuse(
                f"{IDENTITY_HEADER} is accepted only in insecure loopback mode; this "
                "coordinator uses TLS client certificates"
            )
        return await handler(request)

    return refuse_header


def _refuse(message: str) -> web.Response:
    return web.json_response({"error": "forbidden", "message": message}, status=403)
