"""The control client against a real Mosquitto with mutual TLS, as in production.

Mosquitto requires a client certificate from the federation's CAs, maps its CN to the
username (``region.eu-west``) and applies a per-principal ACL.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from geofed.backoff import Backoff
from geofed.control import Command, ControlClient, RegionStatus, decode, encode
from tests.support.control import (
    KEEPALIVE_S,
    SLACK_S,
    TOPICS,
    Inbox,
    RecordingSleep,
    reap,
    running,
    start_agent,
)
from tests.support.mosquitto import MosquittoBroker, run_mosquitto
from tests.support.pki import Federation, Principal, make_federation
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

ACL = """
user coordinator.main
topic readwrite geofed/acme/#
"""
for _region in ("eu-west", "us-east"):
    ACL += f"""
user region.{_region}
topic readwrite geofed/acme/regions/{_region}/status
topic read geofed/acme/regions/{_region}/commands
topic read geofed/acme/jobs/+/round
topic write geofed/acme/events
"""


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    return make_federation(tmp_path_factory.mktemp("pki"), "acme")


@pytest.fixture
def mosquitto(federation: Federation, tmp_path: Path) -> Iterator[MosquittoBroker]:
    # One broker per test: retained messages must not leak from one test to the next.
    server = federation.coordinator("broker")
    with run_mosquitto(
        tmp_path,
        cafile=federation.ca_file,
        certfile=server.cert_file,
        keyfile=server.key_file,
        acl=ACL,
    ) as broker:
        yield broker


def tls_client(
    broker: MosquittoBroker, client_id: str, context: ssl.SSLContext, **kwargs: Any
) -> ControlClient:
    kwargs.setdefault("timeout_s", 5.0)
    return ControlClient(broker.host, broker.port, client_id=client_id, tls=context, **kwargs)


def principal_client(
    broker: MosquittoBroker, federation: Federation, principal: Principal
) -> ControlClient:
    context = principal.client_context(federation.bundle())
    return tls_client(broker, principal.identity.name, context)


async def test_federation_certificates_connect_and_round_trip(
    mosquitto: MosquittoBroker, federation: Federation
) -> None:
    coordinator = principal_client(mosquitto, federation, federation.coordinator())
    region = principal_client(mosquitto, federation, federation.region("eu-west"))
    statuses, commands = Inbox(), Inbox()
    await coordinator.subscribe(TOPICS.all_region_status(), statuses)
    await region.subscribe(TOPICS.region_commands("eu-west"), commands)
    async with running(coordinator), running(region):
        status = RegionStatus(region="eu-west", state="online", agent_version="t")
        await region.publish(TOPICS.region_status("eu-west"), encode(status), retain=True)
        assert decode((await statuses.get())[1], RegionStatus) == status
        command = Command(action="resync", job="llm-7", reason="hash mismatch")
        await coordinator.publish(TOPICS.region_commands("eu-west"), encode(command))
        assert decode((await commands.get())[1], Command) == command
    assert "u'region.eu-west'" in mosquitto.log_text()


async def test_acl_keeps_a_region_to_its_own_topics(
    mosquitto: MosquittoBroker, federation: Federation
) -> None:
    coordinator = principal_client(mosquitto, federation, federation.coordinator())
    region = principal_client(mosquitto, federation, federation.region("eu-west"))
    statuses, commands = Inbox(), Inbox()
    await coordinator.subscribe(TOPICS.all_region_status(), statuses)
    await region.subscribe(TOPICS.all_region_commands(), commands)
    async with running(coordinator), running(region):
        # Messages on one connection arrive in order, so once the allowed message is in,
        # the denied one sent before it would have been too.
        forged = RegionStatus(region="us-east", state="offline", agent_version="t")
        await region.publish(TOPICS.region_status("us-east"), encode(forged))
        await region.publish(TOPICS.region_status("eu-west"), b"mine")
        assert await statuses.get() == (TOPICS.region_status("eu-west"), b"mine")
        await coordinator.publish(TOPICS.region_commands("us-east"), b"theirs")
        await coordinator.publish(TOPICS.region_commands("eu-west"), b"ours")
        assert await commands.get() == (TOPICS.region_commands("eu-west"), b"ours")
    assert "Denied PUBLISH from eu-west" in mosquitto.log_text()


async def assert_refused(client: ControlClient, broker: MosquittoBroker, log_line: str) -> None:
    task = asyncio.create_task(client.run())
    try:
        await eventually(lambda: client.connect_failures >= 1)
        assert not client.connected.is_set()
        assert client.reconnects == 0
    finally:
        await client.close(timeout_s=5)
        await asyncio.wait_for(task, 10)
    await eventually(lambda: log_line in broker.log_text(), timeout_s=5)


def refusal_client(broker: MosquittoBroker, context: ssl.SSLContext) -> ControlClient:
    # A short timeout: with TLS 1.3 the broker's refusal arrives after the handshake, and
    # aiomqtt only notices when its wait for the CONNACK ends.
    return tls_client(
        broker, "intruder", context, timeout_s=1.0, sleep=RecordingSleep(), backoff=Backoff()
    )


async def test_client_without_certificate_is_refused(
    mosquitto: MosquittoBroker, federation: Federation
) -> None:
    context = ssl.create_default_context(cafile=federation.ca_file)
    client = refusal_client(mosquitto, context)
    await assert_refused(client, mosquitto, "peer did not return a certificate")


async def test_client_with_certificate_from_another_ca_is_refused(
    mosquitto: MosquittoBroker, federation: Federation
) -> None:
    if "rogue" not in federation.untrusted:
        federation.add_untrusted_authority("rogue")
    impostor = federation.region("eu-west", authority="rogue")
    client = refusal_client(mosquitto, impostor.client_context(federation.bundle()))
    await assert_refused(client, mosquitto, "certificate verify failed")


# paho-mqtt 2.2 does not close its socket when the TLS handshake fails (the SSLSocket is
# left to the garbage collector); only this test makes a handshake fail on the client.
@pytest.mark.filterwarnings("ignore:unclosed <ssl.SSLSocket:ResourceWarning")
async def test_client_refuses_a_broker_the_federation_did_not_certify(
    federation: Federation, tmp_path: Path
) -> None:
    if "rogue" not in federation.untrusted:
        federation.add_untrusted_authority("rogue")
    fake = federation.coordinator("fake-broker", authority="rogue")
    with run_mosquitto(
        tmp_path, cafile=federation.ca_file, certfile=fake.cert_file, keyfile=fake.key_file
    ) as broker:
        region = federation.region("eu-west")
        client = refusal_client(broker, region.client_context(federation.bundle()))
        task = asyncio.create_task(client.run())
        try:
            await eventually(lambda: client.connect_failures >= 1)
            assert not client.connected.is_set()
        finally:
            await client.close(timeout_s=5)
            await asyncio.wait_for(task, 10)
            gc.collect()  # collect leaked sockets while the filter above applies
        assert "New client connected" not in broker.log_text()


async def test_hung_agent_goes_offline_after_keepalive(
    mosquitto: MosquittoBroker, federation: Federation
) -> None:
    """A stopped (not dead) agent keeps its socket open; only keep-alive can tell."""
    agent = federation.region("eu-west")
    child = await start_agent(
        mosquitto.port, str(federation.bundle_file), str(agent.cert_file), str(agent.key_file)
    )
    try:
        inbox = Inbox()
        watcher = principal_client(mosquitto, federation, federation.coordinator())
        await watcher.subscribe(TOPICS.region_status("eu-west"), inbox)
        async with running(watcher):
            await inbox.until(lambda _t, p: decode(p, RegionStatus).state == "online")
            child.send_signal(signal.SIGSTOP)
            _, payload = await inbox.get(timeout_s=KEEPALIVE_S * 1.5 + SLACK_S)
        assert decode(payload, RegionStatus).state == "offline"
    finally:
        reap(child)
