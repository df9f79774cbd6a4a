"""The production Mosquitto config and the generated ACL, enforced by a real broker.

The broker runs deploy/mosquitto/mosquitto.conf as shipped, with only its paths, its
listener address and its user rewritten for the test (plus debug logging); the ACL is
what ``geofed mqtt acl`` writes for the example region policies. A regional broker is
bridged with bridge-region.conf.example, rewritten the same way. Clients present
certificates of a throwaway federation, so each one's username is its CN.

Mosquitto acknowledges a denied QoS 1 PUBLISH from an MQTT 3.1.1 client and drops it.
Two ways to show that a message never arrived, without waiting for a timeout:

- on one connection messages stay in order, so once a later, allowed message from the
  same publisher is in, a denied one sent before it would have arrived first;
- the broker routes a message before it acknowledges it, so once a publisher's PUBACK
  is back, a marker published afterwards by anyone reaches a subscriber after it.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiomqtt
import pytest

from geofed.control import ControlClient, Publication, Topics
from geofed.mqtt_acl import Principals, render_acl
from geofed.types import Role
from geofed_cli import main
from tests.support.mosquitto import MosquittoBroker
from tests.support.mosquitto_production import PRODUCTION_CONF, production_broker, rewritten
from tests.support.pki import LOOPBACK_DNS, LOOPBACK_IPS, Federation, Principal, make_federation
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MOSQUITTO_SUB = Path("/usr/bin/mosquitto_sub")
BRIDGE_EXAMPLE = REPO / "deploy" / "mosquitto" / "bridge-region.conf.example"
EXAMPLE_POLICIES = REPO / "configs" / "policies"  # regions ap-south, eu-west, us-east
TOPICS = Topics("acme")


def bridge_config(upstream: MosquittoBroker, federation: Federation, region: Principal) -> str:
    """deploy/mosquitto/bridge-region.conf.example for ``region``, to ``upstream``."""
    assert region.identity.name == "eu-west", "the example bridges region eu-west of acme"
    return rewritten(
        BRIDGE_EXAMPLE,
        {
            "address": f"{upstream.host}:{upstream.port}",
            "bridge_cafile": str(federation.ca_file),
            "bridge_certfile": str(region.cert_file),
            "bridge_keyfile": str(region.key_file),
        },
    )


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    return make_federation(tmp_path_factory.mktemp("pki"), "acme")


@pytest.fixture(scope="module")
def acl_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("acl") / "acl"
    args = ["mqtt", "acl", "--policies", str(EXAMPLE_POLICIES), "--federation", "acme"]
    assert main([*args, "--observer", "grafana", "--out", str(path)]) == 0
    return path


@pytest.fixture(scope="module")
def principals(federation: Federation) -> dict[str, Principal]:
    return {
        "coordinator": federation.coordinator("main"),
        "eu-west": federation.region("eu-west"),
        "us-east": federation.region("us-east"),
        "mars": federation.region("mars"),  # a valid certificate, but no policy file
        "grafana": federation.observer("grafana"),
        # The broker's own certificate: the least privileged role, with loopback SANs.
        "broker": federation.issue(
            Role.OBSERVER, "mqtt-broker", dns_names=LOOPBACK_DNS, ip_addresses=LOOPBACK_IPS
        ),
        "regional-broker": federation.issue(
            Role.OBSERVER, "mqtt-eu-west", dns_names=LOOPBACK_DNS, ip_addresses=LOOPBACK_IPS
        ),
    }


@pytest.fixture
async def broker(
    federation: Federation, principals: dict[str, Principal], acl_file: Path, tmp_path: Path
) -> AsyncIterator[MosquittoBroker]:
    # One broker per test: retained messages must not leak from one test to the next.
    async with production_broker(federation, principals, acl_file, tmp_path) as running:
        yield running


class Inbox:
    """Collects the (topic, payload) pairs a subscription receives."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()

    async def __call__(self, topic: str, payload: bytes) -> None:
        await self.queue.put((topic, payload))

    async def get(self, timeout_s: float = 5.0) -> tuple[str, bytes]:
        return await asyncio.wait_for(self.queue.get(), timeout_s)

    def empty(self) -> bool:
        return self.queue.empty()


class Clients:
    """Control clients of the federation's principals, started and closed together."""

    def __init__(
        self, broker: MosquittoBroker, federation: Federation, principals: dict[str, Principal]
    ) -> None:
        self.broker, self.federation, self.principals = broker, federation, principals
        self.clients: dict[str, ControlClient] = {}

    def client(self, who: str, client_id: str | None = None) -> ControlClient:
        principal = self.principals[who]
        will = None
        if principal.identity.role is Role.REGION:
            # As the agent does: its status topic carries its Last Will.
            will = Publication(TOPICS.region_status(principal.identity.name), b"offline")
        client = ControlClient(
            self.broker.host,
            self.broker.port,
            client_id=client_id or f"test-{who}",
            tls=principal.client_context(self.federation.bundle()),
            will=will,
            timeout_s=5.0,
        )
        self.clients[who if client_id is None else f"{who} as {client_id}"] = client
        return client

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Clients]:
        tasks = [asyncio.create_task(client.run()) for client in self.clients.values()]
        try:
            for client in self.clients.values():
                await client.wait_connected(10.0)
            yield self
        finally:
            for client in self.clients.values():
                await client.close(timeout_s=5.0)
            await asyncio.wait_for(asyncio.gather(*tasks), 10.0)


@pytest.fixture
def clients(
    broker: MosquittoBroker, federation: Federation, principals: dict[str, Principal]
) -> Clients:
    return Clients(broker, federation, principals)


async def test_a_region_cannot_publish_another_regions_status(
    clients: Clients, broker: MosquittoBroker
) -> None:
    statuses = Inbox()
    await clients.client("coordinator").subscribe(TOPICS.all_region_status(), statuses)
    eu_west, us_east = clients.client("eu-west"), clients.client("us-east")
    async with clients.running():
        await eu_west.publish(TOPICS.region_status("us-east"), b"forged by eu-west")
        await eu_west.publish(TOPICS.region_status("eu-west"), b"eu-west online")
        assert await statuses.get() == (TOPICS.region_status("eu-west"), b"eu-west online")
        await us_east.publish(TOPICS.region_status("us-east"), b"us-east online")
        assert await statuses.get() == (TOPICS.region_status("us-east"), b"us-east online")
        assert statuses.empty()
    # The broker names clients by username: use_username_as_clientid replaced "test-eu-west".
    assert "Denied PUBLISH from region.eu-west" in broker.log_text()


async def test_a_region_cannot_announce_command_or_post_events(clients: Clients) -> None:
    seen = Inbox()
    await clients.client("grafana").subscribe(TOPICS.everything(), seen)
    eu_west = clients.client("eu-west")
    async with clients.running():
        await eu_west.publish(TOPICS.job_round("llm-7"), b"forged announcement", retain=True)
        await eu_west.publish(TOPICS.region_commands("us-east"), b"forged command")
        await eu_west.publish(TOPICS.region_commands("eu-west"), b"command to itself")
        await eu_west.publish(TOPICS.events(), b"forged event")
        await eu_west.publish("geofed/other-federation/events", b"elsewhere")
        await eu_west.publish(TOPICS.region_status("eu-west"), b"eu-west online")
        assert await seen.get() == (TOPICS.region_status("eu-west"), b"eu-west online")
        assert seen.empty()


async def test_an_unlisted_region_and_an_observer_cannot_publish(clients: Clients) -> None:
    seen = Inbox()
    await clients.client("coordinator").subscribe(TOPICS.all_region_status(), seen)
    await clients.client("eu-west").subscribe(TOPICS.all_job_rounds(), seen)
    mars, grafana = clients.client("mars"), clients.client("grafana")
    coordinator, eu_west = clients.clients["coordinator"], clients.clients["eu-west"]
    async with clients.running():
        # Each publish returns on the broker's PUBACK, after it routed (or dropped) it.
        await mars.publish(TOPICS.region_status("mars"), b"mars online")
        await grafana.publish(TOPICS.region_status("eu-west"), b"forged by an observer")
        await grafana.publish(TOPICS.job_round("llm-7"), b"forged by an observer")
        await grafana.publish(TOPICS.region_commands("eu-west"), b"forged by an observer")
        # One marker per subscription, routed after the forgeries: each subscriber receives
        # in routing order, so a forgery that got through would come before its marker.
        markers = {
            (TOPICS.job_round("llm-7"), b"marker"),
            (TOPICS.region_status("eu-west"), b"eu-west online"),
        }
        await coordinator.publish(TOPICS.job_round("llm-7"), b"marker")
        await eu_west.publish(TOPICS.region_status("eu-west"), b"eu-west online")
        assert {await seen.get(), await seen.get()} == markers
        assert seen.empty()


async def test_the_coordinator_reaches_regions_and_observers(clients: Clients) -> None:
    rounds = {region: Inbox() for region in ("eu-west", "us-east")}
    commands = {region: Inbox() for region in ("eu-west", "us-east")}
    for region in rounds:
        client = clients.client(region)
        await client.subscribe(TOPICS.all_job_rounds(), rounds[region])
        # A region may subscribe to every region's commands; it only receives its own.
        await client.subscribe(TOPICS.all_region_commands(), commands[region])
        await client.subscribe(TOPICS.events(), rounds[region])
    watched = Inbox()
    await clients.client("grafana").subscribe(TOPICS.everything(), watched)
    coordinator = clients.client("coordinator")
    async with clients.running():
        await coordinator.publish(TOPICS.job_round("llm-7"), b"round 3", retain=True)
        await coordinator.publish(TOPICS.region_commands("us-east"), b"resync us-east")
        await coordinator.publish(TOPICS.region_commands("eu-west"), b"pause eu-west")
        await coordinator.publish(TOPICS.events(), b"round closed")
        for region in rounds:
            assert await rounds[region].get() == (TOPICS.job_round("llm-7"), b"round 3")
            assert await rounds[region].get() == (TOPICS.events(), b"round closed")
        assert await commands["eu-west"].get() == (
            TOPICS.region_commands("eu-west"),
            b"pause eu-west",
        )
        assert await commands["us-east"].get() == (
            TOPICS.region_commands("us-east"),
            b"resync us-east",
        )
        assert [await watched.get() for _ in range(4)] == [
            (TOPICS.job_round("llm-7"), b"round 3"),
            (TOPICS.region_commands("us-east"), b"resync us-east"),
            (TOPICS.region_commands("eu-west"), b"pause eu-west"),
            (TOPICS.events(), b"round closed"),
        ]
        assert commands["eu-west"].empty()
        assert commands["us-east"].empty()


async def test_a_region_cannot_take_over_the_coordinators_session(
    clients: Clients, broker: MosquittoBroker
) -> None:
    seen = Inbox()
    await clients.client("grafana").subscribe(TOPICS.events(), seen)
    coordinator = clients.client("coordinator", client_id="coordinator-main")
    impostor = clients.client("eu-west", client_id="coordinator-main")
    async with clients.running():
        # Both are connected now; without use_username_as_clientid the second connection
        # with the same client id would have closed the coordinator's.
        await coordinator.publish(TOPICS.events(), b"still here")
        assert await seen.get() == (TOPICS.events(), b"still here")
        assert coordinator.reconnects == 0
        assert impostor.reconnects == 0
    assert "already connected, closing old connection" not in broker.log_text()


@pytest.fixture
def mosquitto_sub() -> Path:
    if not MOSQUITTO_SUB.exists():
        pytest.fail(f"{MOSQUITTO_SUB} not found; install it: apt-get install -y mosquitto-clients")
    return MOSQUITTO_SUB


# How mosquitto logs a connection that ended without a DISCONNECT (a killed client): any
# end but the clean "disconnected." (newer versions put the address after the name).
CONNECTION_LOST = re.compile(
    r"Client region\.eu-west( \[[^\]]*\])? (closed its connection|disconnected[:,]"
    r"|disconnected due to)|Socket error on client region\.eu-west"
)


async def test_a_region_cannot_forge_another_regions_last_will(
    clients: Clients,
    broker: MosquittoBroker,
    federation: Federation,
    principals: dict[str, Principal],
    mosquitto_sub: Path,
) -> None:
    """A region whose connection dies has its Last Will sent, but only to its own topics."""
    statuses = Inbox()
    await clients.client("coordinator").subscribe(TOPICS.all_region_status(), statuses)
    us_east = clients.client("us-east")
    eu_west = principals["eu-west"]
    async with clients.running():
        # A real client that can die without a DISCONNECT: mosquitto_sub, SIGKILLed.
        dying = await asyncio.create_subprocess_exec(
            str(mosquitto_sub), "-h", broker.host, "-p", str(broker.port),
             "--cafile", str(federation.ca_file), "--cert", str(eu_west.cert_file),
             "--key", str(eu_west.key_file), "-t", TOPICS.events(),
             "--will-topic", TOPICS.region_status("us-east"), "--will-payload", "forged offline",
             "--will-qos", "1",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            # Killed once at rest (subscribed): killed mid-packet, the broker logs a protocol
            # error instead, and sends the Will all the same.
            await eventually(lambda: "Received SUBSCRIBE from region.eu-west" in broker.log_text())
        finally:
            dying.kill()  # no DISCONNECT: the broker sends the Will, if the ACL allows it
            await asyncio.wait_for(dying.wait(), 5)
        await eventually(lambda: CONNECTION_LOST.search(broker.log_text()) is not None)
        await us_east.publish(TOPICS.region_status("us-east"), b"us-east online")
        assert await statuses.get() == (TOPICS.region_status("us-east"), b"us-east online")
        assert statuses.empty()


async def test_a_client_without_a_certificate_is_refused(
    broker: MosquittoBroker, federation: Federation
) -> None:
    context = ssl.create_default_context(cafile=federation.ca_file)
    with pytest.raises(aiomqtt.MqttError):
        async with aiomqtt.Client(
            broker.host, broker.port, identifier="intruder", tls_context=context, timeout=2
        ):
            pass
    await eventually(lambda: "peer did not return a certificate" in broker.log_text())
    assert "intruder" not in broker.log_text()


async def test_retained_announcements_survive_a_broker_restart(
    federation: Federation, principals: dict[str, Principal], acl_file: Path, tmp_path: Path
) -> None:
    async with production_broker(federation, principals, acl_file, tmp_path) as first:
        clients = Clients(first, federation, principals)
        coordinator = clients.client("coordinator")
        async with clients.running():
            await coordinator.publish(TOPICS.job_round("llm-7"), b"round 3", retain=True)
    assert (tmp_path / "state" / "mosquitto.db").exists()
    async with production_broker(federation, principals, acl_file, tmp_path) as second:
        clients = Clients(second, federation, principals)
        rounds = Inbox()
        await clients.client("eu-west").subscribe(TOPICS.all_job_rounds(), rounds)
        async with clients.running():
            assert await rounds.get() == (TOPICS.job_round("llm-7"), b"round 3")


async def test_a_reloaded_acl_cuts_a_removed_region_off(
    federation: Federation,
    principals: dict[str, Principal],
    acl_file: Path,
    tmp_path: Path,
) -> None:
    """The README's procedure: regenerate the ACL, SIGHUP the broker."""
    acl = tmp_path / "acl"
    shutil.copyfile(acl_file, acl)
    async with production_broker(federation, principals, acl, tmp_path) as broker:
        before = Clients(broker, federation, principals)
        eu_west, us_east = before.client("eu-west"), before.client("us-east")
        async with before.running():
            await eu_west.publish(TOPICS.region_status("eu-west"), b"eu-west online", retain=True)
            await us_east.publish(TOPICS.region_status("us-east"), b"us-east online", retain=True)
        acl.write_text(render_acl(Principals("acme", regions=("ap-south", "eu-west"))))
        os.kill(broker.pid, signal.SIGHUP)
        await eventually(lambda: "Reloading config" in broker.log_text())
        after = Clients(broker, federation, principals)
        statuses = Inbox()
        await after.client("coordinator").subscribe(TOPICS.all_region_status(), statuses)
        eu_west, us_east = after.client("eu-west"), after.client("us-east")
        async with after.running():
            await us_east.publish(TOPICS.region_status("us-east"), b"us-east again")
            await eu_west.publish(TOPICS.region_status("eu-west"), b"marker")
            received = [await statuses.get()]
            while received[-1][1] != b"marker":
                received.append(await statuses.get())
    # us-east's retained status is withheld (check_retain_source) and its new one denied.
    assert received == [
        (TOPICS.region_status("eu-west"), b"eu-west online"),
        (TOPICS.region_status("eu-west"), b"marker"),
    ]


@asynccontextmanager
async def bridged_region(
    upstream: MosquittoBroker,
    federation: Federation,
    principals: dict[str, Principal],
    acl_file: Path,
    workdir: Path,
    *,
    edit: Callable[[str], str] = lambda text: text,
) -> AsyncIterator[MosquittoBroker]:
    """Region eu-west's own broker, bridged to ``upstream`` as the example says."""
    bridge = edit(bridge_config(upstream, federation, principals["eu-west"]))
    async with production_broker(
        federation, principals, acl_file, workdir, server_name="regional-broker", extra=bridge
    ) as regional:
        yield regional


async def test_a_bridged_region_talks_through_its_regional_broker(
    broker: MosquittoBroker, federation: Federation, principals: dict[str, Principal],
    acl_file: Path, tmp_path: Path,
) -> None:  # fmt: skip
    on_global = Clients(broker, federation, principals)
    statuses = Inbox()
    await on_global.client("coordinator").subscribe(TOPICS.all_region_status(), statuses)
    async with on_global.running():
        coordinator = on_global.clients["coordinator"]
        # Retained on the global broker before the regional one exists.
        await coordinator.publish(TOPICS.job_round("llm-7"), b"round 3", retain=True)
        async with bridged_region(
            broker, federation, principals, acl_file, tmp_path / "regional"
        ) as regional:
            on_site = Clients(regional, federation, principals)
            agent = on_site.client("eu-west")
            inbox = Inbox()
            await agent.subscribe(TOPICS.all_job_rounds(), inbox)
            await agent.subscribe(TOPICS.region_commands("eu-west"), inbox)
            await agent.subscribe(TOPICS.events(), inbox)
            async with on_site.running():
                # The bridge subscribes upstream as it connects; give it the time to.
                assert await inbox.get(timeout_s=10) == (TOPICS.job_round("llm-7"), b"round 3")
                await agent.publish(TOPICS.region_status("eu-west"), b"eu-west online")
                assert await statuses.get() == (TOPICS.region_status("eu-west"), b"eu-west online")
                await coordinator.publish(TOPICS.region_commands("eu-west"), b"pause")
                await coordinator.publish(TOPICS.region_commands("us-east"), b"not for eu-west")
                await coordinator.publish(TOPICS.events(), b"round closed")
                assert await inbox.get() == (TOPICS.region_commands("eu-west"), b"pause")
                assert await inbox.get() == (TOPICS.events(), b"round closed")
            # The announcement crossed the bridge as a retained message: a client that
            # arrives later still gets it from the regional broker.
            late = Clients(regional, federation, principals)
            rounds = Inbox()
            await late.client("grafana").subscribe(TOPICS.all_job_rounds(), rounds)
            async with late.running():
                assert await rounds.get() == (TOPICS.job_round("llm-7"), b"round 3")
    assert "u'region.eu-west'" in broker.log_text()


async def test_the_global_acl_bounds_a_misconfigured_bridge(
    broker: MosquittoBroker, federation: Federation, principals: dict[str, Principal],
    acl_file: Path, tmp_path: Path,
) -> None:  # fmt: skip
    def forward_every_status(text: str) -> str:
        mine = f"topic {TOPICS.region_status('eu-west')} out 1"
        assert mine in text
        return text.replace(mine, f"topic {TOPICS.all_region_status()} out 1")

    on_global = Clients(broker, federation, principals)
    statuses = Inbox()
    await on_global.client("coordinator").subscribe(TOPICS.all_region_status(), statuses)
    async with on_global.running():
        await on_global.clients["coordinator"].publish(
            TOPICS.job_round("llm-7"), b"round 3", retain=True
        )
        async with bridged_region(
            broker, federation, principals, acl_file, tmp_path / "regional",
            edit=forward_every_status,
        ) as regional:  # fmt: skip
            on_site = Clients(regional, federation, principals)
            agent, intruder = on_site.client("eu-west"), on_site.client("us-east")
            rounds = Inbox()
            await agent.subscribe(TOPICS.all_job_rounds(), rounds)
            async with on_site.running():
                await rounds.get(timeout_s=10)  # the bridge is up
                # us-east may publish its own status on this broker, and the bridge
                # forwards it, but upstream it comes from region.eu-west: dropped.
                await intruder.publish(TOPICS.region_status("us-east"), b"via eu-west's bridge")
                await agent.publish(TOPICS.region_status("eu-west"), b"eu-west online")
                assert await statuses.get() == (TOPICS.region_status("eu-west"), b"eu-west online")
                assert statuses.empty()
    assert "Denied PUBLISH from region.eu-west" in broker.log_text()


def test_the_production_config_has_no_plain_listener() -> None:
    settings: dict[str, list[str]] = {}
    for line in PRODUCTION_CONF.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            settings.setdefault(key, []).append(value)
    assert settings["listener"] == ["8883"]
    assert settings["require_certificate"] == ["true"]
    assert settings["use_identity_as_username"] == ["true"]
    assert settings["allow_anonymous"] == ["false"]
    assert int(settings["max_queued_messages"][0]) > 1000
    for plain in ("port", "bind_address", "password_file", "psk_file", "include_dir"):
        assert plain not in settings, f"{plain} would open another way in"
