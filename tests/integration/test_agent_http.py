"""The agent's HTTP client: identity (mTLS or the loopback header), errors, resumed downloads.

The servers here are fakes at the outer edge: small aiohttp apps on loopback, one with
the federation's real TLS contexts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from geofed.timeouts import Timeouts
from regional_agent.config import AgentConfig
from regional_agent.credentials import AgentIdentityConfig, Credentials, load_credentials
from regional_agent.transfer.coordinator_client import (
    IDENTITY_HEADER,
    CoordinatorClient,
    HttpError,
    TransportError,
    UntrustedServer,
    build_session,
)
from tests.support.agent_credentials import agent_credentials
from tests.support.pki import Federation, Principal, make_federation

TIMEOUTS = Timeouts(connect_s=1, heartbeat_s=0.5, request_s=2, upload_s=5, download_s=5)
BLOB = bytes(range(256)) * 512  # 128 KiB


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    return make_federation(tmp_path_factory.mktemp("pki"), "acme")


@pytest.fixture(scope="module")
def region(federation: Federation) -> Credentials:
    principal = federation.region("eu-west")
    return agent_credentials(federation, principal)


def config(url: str, *, insecure: bool) -> AgentConfig:
    return AgentConfig.model_validate(
        {
            "federation": "acme",
            "region": "eu-west",
            "policy": "policy.yaml",
            "coordinator_url": url,
            "identity": {"cert": "c", "key": "k", "trust_bundle": "t"},
            "insecure_loopback": insecure,
            "state_dir": "state",
            "timeouts": TIMEOUTS,
        }
    )


class FakeFileServer:
    """Serves BLOB at /blob, cutting the first answer off after ``cut_at`` bytes."""

    def __init__(self, cut_at: int | None = None) -> None:
        self.cut_at = cut_at
        self.ranges: list[str | None] = []
        self.identities: list[str | None] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/blob", self._blob)
        app.router.add_get("/whoami", self._whoami)
        app.router.add_get("/busy", self._busy)
        app.router.add_get("/missing", self._missing)
        return app

    async def _whoami(self, request: web.Request) -> web.Response:
        self.identities.append(request.headers.get(IDENTITY_HEADER))
        return web.json_response({"ok": True})

    async def _busy(self, request: web.Request) -> web.Response:
        return web.Response(status=503, text="overloaded")

    async def _missing(self, request: web.Request) -> web.Response:
        return web.json_response({"error": "not_found", "message": "no such update"}, status=404)

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        header = request.headers.get("Range")
        self.ranges.append(header)
        if header is None and self.cut_at is not None:
            response = web.StreamResponse(headers={"Content-Length": str(len(BLOB))})
            await response.prepare(request)
            await response.write(BLOB[: self.cut_at])
            await response.drain()
            assert request.transport is not None
            request.transport.close()
            return response
        start = int(header.removeprefix("bytes=").rstrip("-")) if header else 0
        status = 206 if header else 200
        headers = {"Content-Range": f"bytes {start}-{len(BLOB) - 1}/{len(BLOB)}"} if header else {}
        return web.Response(body=BLOB[start:], status=status, headers=headers)


@pytest_asyncio.fixture
async def plain_server() -> AsyncIterator[tuple[FakeFileServer, str]]:
    fake = FakeFileServer(cut_at=50_000)
    server = TestServer(fake.app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield fake, str(server.make_url("/"))
    finally:
        await server.close()


async def serve_tls(
    principal: Principal, federation: Federation
) -> tuple[FakeFileServer, web.AppRunner, str]:
    fake = FakeFileServer()
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(
        runner, "127.0.0.1", 0, ssl_context=principal.server_context(federation.bundle())
    )
    await site.start()
    port = runner.addresses[0][1]
    return fake, runner, f"https://localhost:{port}/"


async def test_insecure_loopback_names_the_region_in_a_header(
    plain_server: tuple[FakeFileServer, str], region: Credentials
) -> None:
    fake, url = plain_server
    async with build_session(config(url, insecure=True), region) as session:
        answer = await CoordinatorClient(session, url, TIMEOUTS).request("GET", "/whoami")
    assert answer.json() == {"ok": True}
    assert fake.identities == ["spiffe://acme/region/eu-west"]


async def test_a_cut_download_resumes_where_it_stopped(
    plain_server: tuple[FakeFileServer, str], region: Credentials
) -> None:
    fake, url = plain_server
    delays: list[float] = []

    async def sleep(delay: float) -> None:
        delays.append(delay)

    async with build_session(config(url, insecure=True), region) as session:
        client = CoordinatorClient(session, url, TIMEOUTS, sleep=sleep)
        data = await client.download("/blob")
    assert data == BLOB
    assert fake.ranges[0] is None
    assert len(fake.ranges) == 2
    resumed_at = int(str(fake.ranges[1]).removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= 50_000  # what arrived before the cut was kept
    assert len(delays) == 1


async def test_a_download_to_a_file_resumes_and_replaces_what_was_there(
    plain_server: tuple[FakeFileServer, str], region: Credentials, tmp_path: Path
) -> None:
    fake, url = plain_server
    target = tmp_path / "update-3.bundle"
    target.write_bytes(b"a stale download, longer than nothing" * 10_000)

    async def sleep(_delay: float) -> None:
        pass

    asked = len(fake.ranges)
    async with build_session(config(url, insecure=True), region) as session:
        client = CoordinatorClient(session, url, TIMEOUTS, sleep=sleep)
        size = await client.download_to("/blob", target)
    assert size == len(BLOB)
    assert target.read_bytes() == BLOB  # the part before the cut, then the rest
    first, resumed = fake.ranges[asked:]
    assert first is None
    assert resumed is not None
    assert 0 < int(resumed.removeprefix("bytes=").rstrip("-")) < len(BLOB)
    assert target.stat().st_mode & 0o777 == 0o600  # θ's updates stay the region's


async def test_error_answers_are_typed(
    plain_server: tuple[FakeFileServer, str], region: Credentials
) -> None:
    _, url = plain_server
    async with build_session(config(url, insecure=True), region) as session:
        client = CoordinatorClient(session, url, TIMEOUTS)
        with pytest.raises(HttpError) as info:
            await client.request("GET", "/missing")
        assert (info.value.status, info.value.code) == (404, "not_found")
        assert "no such update" in str(info.value)
        with pytest.raises(TransportError, match="HTTP 503"):
            await client.request("GET", "/busy")


async def test_mtls_talks_to_a_coordinator_of_the_federation(
    federation: Federation, region: Credentials
) -> None:
    fake, runner, url = await serve_tls(federation.coordinator(), federation)
    try:
        async with build_session(config(url, insecure=False), region) as session:
            client = CoordinatorClient(session, url, TIMEOUTS)
            assert (await client.request("GET", "/whoami")).json() == {"ok": True}
            assert await client.download("/blob") == BLOB
    finally:
        await runner.cleanup()
    assert fake.identities == [None]  # the certificate speaks, not a header


async def test_mtls_refuses_a_server_that_is_not_a_coordinator(
    federation: Federation, region: Credentials
) -> None:
    impostor = federation.issue("region", "us-east", dns_names=("localhost",))
    fake, runner, url = await serve_tls(impostor, federation)
    try:
        async with build_session(config(url, insecure=False), region) as session:
            client = CoordinatorClient(session, url, TIMEOUTS)
            with pytest.raises(UntrustedServer, match="expected coordinator"):
                await client.request("GET", "/whoami")
            with pytest.raises(UntrustedServer):
                await client.download("/blob")
    finally:
        await runner.cleanup()
    assert fake.identities == []


async def test_mtls_refuses_a_coordinator_revoked_after_the_agent_started(
    tmp_path: Path,
) -> None:
    # A federation of its own: the revocation must not reach the other tests.
    own = make_federation(tmp_path / "pki", "acme")
    principal = own.region("eu-west")
    files = AgentIdentityConfig(
        cert=principal.cert_file, key=principal.key_file, trust_bundle=own.bundle_file
    )
    region = load_credentials(files, principal.identity)
    coordinator = own.coordinator()
    _, runner, url = await serve_tls(coordinator, own)
    try:
        async with build_session(config(url, insecure=False), region) as session:
            client = CoordinatorClient(session, url, TIMEOUTS)
            assert (await client.request("GET", "/whoami")).json() == {"ok": True}
        own.revoke(coordinator)  # geofed ca revoke: the bundle file changes, nothing restarts
        async with build_session(config(url, insecure=False), region) as session:
            client = CoordinatorClient(session, url, TIMEOUTS)
            with pytest.raises(UntrustedServer, match="revoked"):
                await client.request("GET", "/whoami")
    finally:
        await runner.cleanup()


async def test_relative_and_absolute_urls(region: Credentials) -> None:
    async with build_session(config("http://127.0.0.1:9/api/", insecure=True), region) as session:
        client = CoordinatorClient(session, "http://127.0.0.1:9/api/", TIMEOUTS)
        assert str(client.url("v1/jobs")) == "http://127.0.0.1:9/api/v1/jobs"
        assert str(client.url("/v1/jobs")) == "http://127.0.0.1:9/v1/jobs"
        assert str(client.url("https://mirror.example/x")) == "https://mirror.example/x"
