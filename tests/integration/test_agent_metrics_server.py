"""The agent's /metrics and /healthz listener: real TLS on a loopback port, real PKI.

The listener is served exactly as the daemon serves it (``metrics_server``, the region's
certificate, client certificates required); clients are aiohttp sessions presenting
certificates of a throwaway federation (``tests/support/pki.py``).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from geofed.pki.httpauth import VerifiedConnector
from geofed.types import Role
from regional_agent.config import AgentConfigError, MetricsConfig, load_config
from regional_agent.credentials import AgentIdentityConfig, Credentials, load_credentials
from regional_agent.metrics import CATALOGUE, AgentMetrics
from regional_agent.metrics_server import (
    MetricsServer,
    MetricsServerError,
    create_metrics_app,
    metrics_server,
)
from tests.support.agent_credentials import agent_credentials
from tests.support.pki import LOOPBACK_DNS, LOOPBACK_IPS, Federation, Principal, make_federation

REGION = "eu-west"
POLICIES = Path(__file__).resolve().parents[2] / "configs" / "policies"
TIMEOUT = aiohttp.ClientTimeout(total=10)


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    return make_federation(tmp_path_factory.mktemp("pki"), "acme")


@pytest.fixture(scope="module")
def agent(fed: Federation) -> Principal:
    """The agent's own identity, with loopback names so clients can check the host."""
    return fed.issue(Role.REGION, REGION, dns_names=LOOPBACK_DNS, ip_addresses=LOOPBACK_IPS)


def credentials_of(fed: Federation, principal: Principal) -> Credentials:
    return agent_credentials(fed, principal)


class Probe:
    """The live values ``refresh()`` reads before each scrape (an outer edge, faked)."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self.metrics = metrics
        self.mqtt_up = True
        self.refreshes = 0

    async def refresh(self) -> None:
        self.refreshes += 1
        self.metrics.set_mqtt_connected(self.mqtt_up)

    def health(self) -> dict[str, str]:
        return {"state": "online", "mqtt": "connected" if self.mqtt_up else "disconnected"}


@pytest_asyncio.fixture
async def served(fed: Federation, agent: Principal) -> AsyncIterator[tuple[MetricsServer, Probe]]:
    registry = CollectorRegistry()
    probe = Probe(AgentMetrics(registry, REGION))
    server = metrics_server(
        MetricsConfig(port=0),
        credentials_of(fed, agent),
        registry,
        refresh=probe.refresh,
        health=probe.health,
    )
    async with server:
        yield server, probe


def session_as(fed: Federation, principal: Principal, agent: Principal) -> aiohttp.ClientSession:
    """A client presenting ``principal`` that talks only to the agent's identity."""
    bundle = fed.bundle()
    connector = VerifiedConnector(bundle, principal.client_context(bundle), expect=agent.identity)
    return aiohttp.ClientSession(connector=connector, timeout=TIMEOUT)


def url(server: MetricsServer, path: str) -> str:
    return server.url.replace("/metrics", path).replace("127.0.0.1", "localhost")


@pytest.mark.parametrize(
    "issue", [Federation.observer, Federation.operator, Federation.coordinator]
)
async def test_readers_scrape_the_catalogue_in_prometheus_text_format(
    fed: Federation,
    agent: Principal,
    served: tuple[MetricsServer, Probe],
    issue: Callable[[Federation], Principal],
) -> None:
    server, probe = served
    async with (
        session_as(fed, issue(fed), agent) as client,
        client.get(url(server, "/metrics")) as answer,
    ):
        assert answer.status == 200
        # prometheus_client's exposition type (the coordinator serves the same).
        assert answer.content_type == "text/plain"
        assert answer.headers["Content-Type"] == CONTENT_TYPE_LATEST
        text = await answer.text()
    families = {family.name for family in text_string_to_metric_families(text)}
    # The parser names counters without their _total suffix.
    assert {spec.name.removesuffix("_total") for spec in CATALOGUE} <= families
    assert 'geofed_agent_mqtt_connected{region="eu-west"} 1.0' in text
    assert probe.refreshes == 1


async def test_each_scrape_refreshes_the_live_values_first(
    fed: Federation, agent: Principal, served: tuple[MetricsServer, Probe]
) -> None:
    server, probe = served
    async with session_as(fed, fed.observer(), agent) as client:
        probe.mqtt_up = False
        async with client.get(url(server, "/metrics")) as answer:
            assert 'geofed_agent_mqtt_connected{region="eu-west"} 0.0' in await answer.text()
        probe.mqtt_up = True
        async with client.get(url(server, "/metrics")) as answer:
            assert 'geofed_agent_mqtt_connected{region="eu-west"} 1.0' in await answer.text()
    assert probe.refreshes == 2


@pytest.mark.parametrize("name", [REGION, "us-east"])
async def test_regions_may_not_read_metrics(
    fed: Federation, agent: Principal, served: tuple[MetricsServer, Probe], name: str
) -> None:
    server, probe = served
    async with (
        session_as(fed, fed.region(name), agent) as client,
        client.get(url(server, "/metrics")) as answer,
    ):
        assert answer.status == 403
        body = await answer.json()
    assert body["error"] == "forbidden"
    assert f"spiffe://acme/region/{name} may not read /metrics" in body["message"]
    assert "coordinator, observer, operator" in body["message"]
    assert probe.refreshes == 0


async def test_healthz_answers_any_federation_identity(
    fed: Federation, agent: Principal, served: tuple[MetricsServer, Probe]
) -> None:
    server, _ = served
    async with session_as(fed, agent, agent) as client:
        async with client.get(url(server, "/healthz")) as answer:
            assert answer.status == 200
            assert await answer.json() == {"status": "ok", "state": "online", "mqtt": "connected"}
        async with client.get(url(server, "/nothing")) as answer:
            assert answer.status == 404
            assert (await answer.json())["error"] == "not_found"


async def test_a_client_without_a_certificate_is_refused_in_the_handshake(
    fed: Federation, served: tuple[MetricsServer, Probe]
) -> None:
    server, probe = served
    context = ssl.create_default_context(cadata=fed.bundle().ca_pem().decode())
    connector = aiohttp.TCPConnector(ssl=context)
    async with aiohttp.ClientSession(connector=connector, timeout=TIMEOUT) as client:
        with pytest.raises((aiohttp.ClientError, ssl.SSLError, ConnectionError)):
            async with client.get(url(server, "/healthz")) as answer:
                await answer.read()
    assert probe.refreshes == 0


async def test_a_certificate_from_an_untrusted_authority_is_refused(
    fed: Federation, agent: Principal, served: tuple[MetricsServer, Probe]
) -> None:
    server, probe = served
    if "rogue" not in fed.untrusted:
        fed.add_untrusted_authority("rogue")
    impostor = fed.issue(Role.OBSERVER, "impostor", authority="rogue")

    async def scrape() -> None:
        async with (
            session_as(fed, impostor, agent) as client,
            client.get(url(server, "/metrics")) as answer,
        ):
            await answer.read()

    with pytest.raises((aiohttp.ClientError, ssl.SSLError, ConnectionError)):
        await scrape()
    assert probe.refreshes == 0


async def test_a_revoked_observer_is_refused_after_the_handshake(
    tmp_path: Path, agent: Principal
) -> None:
    # Its own federation: revocation must not leak into the module's other tests.
    own = make_federation(tmp_path / "pki", "acme")
    region = own.issue(Role.REGION, REGION, dns_names=LOOPBACK_DNS, ip_addresses=LOOPBACK_IPS)
    observer = own.observer()
    own.revoke(observer)
    registry = CollectorRegistry()
    AgentMetrics(registry, REGION)
    app = create_metrics_app(registry, own.bundle)
    async with (
        MetricsServer(app, "127.0.0.1", 0, region.server_context(own.bundle())) as server,
        session_as(own, observer, region) as client,
        client.get(url(server, "/metrics")) as answer,
    ):
        assert answer.status == 403
        assert (await answer.json())["error"] == "revoked"


async def test_a_failing_or_hanging_refresh_still_answers_the_scrape(
    fed: Federation, agent: Principal
) -> None:
    registry = CollectorRegistry()
    AgentMetrics(registry, REGION)
    calls: list[str] = []

    async def broken() -> None:
        calls.append("broken")
        raise RuntimeError("restart count unreadable")

    async def stuck() -> None:
        calls.append("stuck")
        await asyncio.Event().wait()

    context = agent.server_context(fed.bundle())
    async with session_as(fed, fed.observer(), agent) as client:
        for refresh in (broken, stuck):
            app = create_metrics_app(registry, fed.bundle(), refresh=refresh, refresh_timeout_s=0.2)
            async with (
                MetricsServer(app, "127.0.0.1", 0, context) as server,
                client.get(url(server, "/metrics")) as answer,
            ):
                assert answer.status == 200
                assert "geofed_agent_worker_restarts_total" in await answer.text()
    assert calls == ["broken", "stuck"]


async def test_a_taken_port_is_a_clear_start_error(fed: Federation, agent: Principal) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        app = create_metrics_app(CollectorRegistry(), fed.bundle())
        server = MetricsServer(app, "127.0.0.1", port, agent.server_context(fed.bundle()))
        with pytest.raises(MetricsServerError, match=f"cannot listen on 127.0.0.1:{port}"):
            await server.start()


def test_the_listener_refuses_a_context_without_client_certificates(agent: Principal) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(agent.cert_file, agent.key_file)
    app = create_metrics_app(CollectorRegistry(), lambda: pytest.fail("never called"))
    with pytest.raises(ValueError, match="requires client certificates"):
        MetricsServer(app, "127.0.0.1", 0, context)


# -- configuration -------------------------------------------------------------------------


def agent_config(tmp_path: Path, fed: Federation, agent: Principal, metrics: str) -> Path:
    path = tmp_path / "agent.yaml"
    path.write_text(
        f"""\
federation: acme
region: {REGION}
policy: {POLICIES / "eu-west.yaml"}
coordinator_url: https://coordinator.acme.example:8443
identity:
  cert: {agent.cert_file}
  key: {agent.key_file}
  trust_bundle: {fed.bundle_file}
state_dir: state
{metrics}"""
    )
    return path


def test_the_listener_defaults_to_loopback_port_9443(
    tmp_path: Path, fed: Federation, agent: Principal
) -> None:
    config = load_config(agent_config(tmp_path, fed, agent, ""))
    assert config.metrics == MetricsConfig(enabled=True, host="127.0.0.1", port=9443)
    custom = load_config(
        agent_config(tmp_path, fed, agent, "metrics: {host: 0.0.0.0, port: 0, enabled: false}\n")
    )
    assert custom.metrics == MetricsConfig(enabled=False, host="0.0.0.0", port=0)


@pytest.mark.parametrize(
    ("metrics", "expected"),
    [
        ("metrics:\n  port: 70000\n", "agent.yaml:11: metrics.port: Input should be less than"),
        ("metrics:\n  port: '9443'\n", "agent.yaml:11: metrics.port: Input should be a valid"),
        ("metrics:\n  enabled: yes please\n", "agent.yaml:11: metrics.enabled: Input should be"),
        ("metrics:\n  host: 'a b'\n", "agent.yaml:11: metrics.host: 'a b' is not a host name"),
        ("metrics:\n  listen: 9443\n", "agent.yaml:11: metrics.listen: unknown key"),
    ],
)
def test_bad_listener_settings_name_file_line_and_key(
    tmp_path: Path, fed: Federation, agent: Principal, metrics: str, expected: str
) -> None:
    with pytest.raises(AgentConfigError) as info:
        load_config(agent_config(tmp_path, fed, agent, metrics))
    found = [str(problem) for problem in info.value.problems]
    assert any(expected in problem for problem in found), found


async def test_a_revocation_applies_to_the_next_scrape_without_a_restart(tmp_path: Path) -> None:
    # A federation of its own: the revocation must not reach the other tests.
    own = make_federation(tmp_path / "pki", "acme")
    agent = own.issue(Role.REGION, REGION, dns_names=LOOPBACK_DNS, ip_addresses=LOOPBACK_IPS)
    files = AgentIdentityConfig(
        cert=agent.cert_file, key=agent.key_file, trust_bundle=own.bundle_file
    )
    credentials = load_credentials(files, agent.identity)
    watcher, kept = own.observer("grafana"), own.observer("prometheus")
    async with metrics_server(MetricsConfig(port=0), credentials, CollectorRegistry()) as server:
        async with (
            session_as(own, watcher, agent) as client,
            client.get(url(server, "/metrics")) as answer,
        ):
            assert answer.status == 200

        own.revoke(watcher)  # geofed ca revoke: the bundle file changes, nothing restarts

        async with (
            session_as(own, watcher, agent) as client,
            client.get(url(server, "/metrics")) as answer,
        ):
            assert answer.status == 403
            assert (await answer.json())["error"] == "revoked"
        async with (
            session_as(own, kept, agent) as client,
            client.get(url(server, "/metrics")) as answer,
        ):
            assert answer.status == 200
