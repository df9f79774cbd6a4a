"""Federation identity over real TLS: an aiohttp server and client on a loopback port.

The bundle trusts two authorities with disjoint grants: org-a may issue the coordinator,
operators and ``region/eu-*``; org-b only ``region/us-*``. OpenSSL refuses unknown CAs
and expired certificates during the handshake; grants and revocations are refused right
after it, by the server middleware (403 JSON) and by the client's connector.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from geofed.pki import (
    NoPeerCertificate,
    OutsideGrant,
    Revoked,
    TrustBundle,
    UnexpectedPeer,
)
from geofed.pki.httpauth import PEER_IDENTITY, VerifiedConnector, identity_middleware
from geofed.types import Identity, Role
from tests.support.pki import Federation, Principal, make_federation

pytestmark = pytest.mark.integration

TIMEOUT = aiohttp.ClientTimeout(total=10)


@pytest.fixture
def fed(tmp_path: Path) -> Federation:
    return make_federation(
        tmp_path / "fed",
        "acme",
        authorities={
            "org-a": ["coordinator/*", "operator/*", "region/eu-*"],
            "org-b": ["region/us-*"],
        },
    )


async def _whoami(request: web.Request) -> web.Response:
    return web.json_response({"peer": request[PEER_IDENTITY].uri})


@asynccontextmanager
async def _server(
    bundle: Callable[[], TrustBundle], server: Principal | None
) -> AsyncIterator[int]:
    """Serve /whoami on an ephemeral loopback port (plain HTTP when ``server`` is None)."""
    app = web.Application(middlewares=[identity_middleware(bundle)])
    app.router.add_get("/whoami", _whoami)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    context = server.server_context(bundle()) if server else None
    site = web.SockSite(runner, sock, ssl_context=context)
    try:
        await site.start()
        yield port
    finally:
        await runner.cleanup()


async def _get(
    port: int,
    client: Principal,
    bundle: Callable[[], TrustBundle],
    *,
    expect: Identity | Role | None = Role.COORDINATOR,
    context: ssl.SSLContext | None = None,
    scheme: str = "https",
) -> tuple[int, dict[str, str]]:
    connector = VerifiedConnector(bundle, context or client.client_context(bundle()), expect=expect)
    async with (
        aiohttp.ClientSession(connector=connector, timeout=TIMEOUT) as session,
        session.get(f"{scheme}://localhost:{port}/whoami") as response,
    ):
        body: dict[str, str] = await response.json()
        return response.status, body


async def test_valid_identities_of_both_authorities_are_accepted_and_extracted(fed):
    async with _server(fed.bundle, fed.coordinator()) as port:
        status, body = await _get(port, fed.region("eu-west"), fed.bundle)
        assert (status, body) == (200, {"peer": "spiffe://acme/region/eu-west"})
        status, body = await _get(port, fed.region("us-east"), fed.bundle)
        assert (status, body) == (200, {"peer": "spiffe://acme/region/us-east"})
        status, body = await _get(port, fed.operator("alice"), fed.bundle)
        assert (status, body) == (200, {"peer": "spiffe://acme/operator/alice"})


async def test_out_of_grant_client_gets_403_json(fed):
    # org-b's chain verifies, but org-b may not issue EU regions.
    forged = fed.region("eu-west", authority="org-b")
    async with _server(fed.bundle, fed.coordinator()) as port:
        status, body = await _get(port, forged, fed.bundle)
    assert status == 403
    assert body["error"] == "outside_grant"
    assert "org-b" in body["message"]


async def test_revocation_is_honoured_on_a_running_server(fed):
    region = fed.region("eu-west")
    async with _server(fed.bundle, fed.coordinator()) as port:
        assert (await _get(port, region, fed.bundle))[0] == 200
        fed.revoke(region)
        status, body = await _get(port, region, fed.bundle)
    assert status == 403
    assert body["error"] == "revoked"
    assert format(region.serial, "x") in body["message"]


async def test_unknown_ca_expired_and_anonymous_clients_are_refused_in_the_handshake(fed):
    # Which check refused them is asserted without sockets in tests/unit/test_pki_tls.py;
    # over TLS 1.3 the client sees only the server closing the connection.
    fed.add_untrusted_authority("rogue")
    now = datetime.now(UTC)
    intruder = fed.region("eu-west", authority="rogue")
    stale = fed.region(
        "eu-west", not_before=now - timedelta(days=2), not_after=now - timedelta(days=1)
    )
    anonymous = ssl.create_default_context(cadata=fed.bundle().ca_pem().decode())
    region = fed.region("eu-west")
    async with _server(fed.bundle, fed.coordinator()) as port:
        with pytest.raises(aiohttp.ClientConnectionError):
            await _get(port, intruder, fed.bundle)
        with pytest.raises(aiohttp.ClientConnectionError):
            await _get(port, stale, fed.bundle)
        with pytest.raises(aiohttp.ClientConnectionError):
            await _get(port, region, fed.bundle, context=anonymous)
        assert (await _get(port, region, fed.bundle))[0] == 200


async def test_plain_http_requests_carry_no_identity(fed):
    async with _server(fed.bundle, None) as port:
        async with (
            aiohttp.ClientSession(timeout=TIMEOUT) as session,
            session.get(f"http://127.0.0.1:{port}/whoami") as response,
        ):
            assert response.status == 403
            assert (await response.json())["error"] == "no_peer_certificate"
        with pytest.raises(NoPeerCertificate):
            await _get(port, fed.region("eu-west"), fed.bundle, scheme="http")


async def test_client_refuses_a_revoked_server_before_sending_the_request(fed):
    coordinator = fed.coordinator()
    fed.revoke(coordinator)
    async with _server(fed.bundle, coordinator) as port:
        with pytest.raises(Revoked):
            await _get(port, fed.region("eu-west"), fed.bundle)


async def test_client_refuses_an_out_of_grant_server(fed):
    impostor = fed.coordinator(authority="org-b")
    async with _server(fed.bundle, impostor) as port:
        with pytest.raises(OutsideGrant):
            await _get(port, fed.region("eu-west"), fed.bundle)


async def test_client_checks_the_expected_server_identity(fed):
    coordinator = fed.coordinator()
    region = fed.region("eu-west")
    async with _server(fed.bundle, coordinator) as port:
        backup = Identity("acme", Role.COORDINATOR, "backup")
        with pytest.raises(UnexpectedPeer, match="expected spiffe://acme/coordinator/backup"):
            await _get(port, region, fed.bundle, expect=backup)
        with pytest.raises(UnexpectedPeer):
            await _get(port, region, fed.bundle, expect=Role.OPERATOR)
        status, _ = await _get(port, region, fed.bundle, expect=coordinator.identity)
        assert status == 200


@pytest.mark.parametrize(
    ("server", "reason"),
    [
        (lambda fed: fed.coordinator(authority="rogue"), "unable to get local issuer certificate"),
        (
            lambda fed: fed.coordinator(
                not_before=datetime.now(UTC) - timedelta(days=2),
                not_after=datetime.now(UTC) - timedelta(days=1),
            ),
            "certificate has expired",
        ),
        # No DNS/IP SANs, so "localhost" does not match.
        (lambda fed: fed.issue(Role.COORDINATOR, "main"), "Hostname mismatch"),
    ],
)
async def test_client_refuses_unknown_ca_expired_and_misnamed_servers(fed, server, reason):
    fed.add_untrusted_authority("rogue")
    async with _server(fed.bundle, server(fed)) as port:
        with pytest.raises(aiohttp.ClientConnectorCertificateError, match=reason):
            await _get(port, fed.region("eu-west"), fed.bundle)
