"""Revoked certificates at the broker: the production config's ``crlfile``, for real.

Mosquitto runs deploy/mosquitto/mosquitto.conf (paths rewritten) with the CRL that
``geofed ca revoke --ca ... --crl ...`` writes. A region holds two certificates, as during a
rotation; once the old one is revoked and the broker re-reads its files (SIGHUP), the old
one can no longer connect, so it cannot take over the live agent's session (the broker
would close the live connection and publish its Last Will), while the new one, and every
other principal, still connects.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiomqtt
import pytest

from geofed.control import ControlClient, Topics
from geofed.mqtt_acl import Principals, render_acl
from geofed.pki import mqtt_username
from geofed_cli import main
from tests.support.mosquitto import MosquittoBroker
from tests.support.mosquitto_production import production_broker
from tests.support.pki import LOOPBACK_DNS, LOOPBACK_IPS, Federation, Principal, make_federation

pytestmark = pytest.mark.integration

TOPICS = Topics("acme")


@pytest.fixture
def federation(tmp_path: Path) -> Federation:
    return make_federation(tmp_path / "pki", "acme")


@pytest.fixture
async def broker(federation: Federation, tmp_path: Path) -> AsyncIterator[MosquittoBroker]:
    acl = tmp_path / "acl"
    acl.write_text(render_acl(Principals("acme", ("eu-west",), observers=("watch",))))
    server = federation.issue(
        "observer", "mqtt-broker", dns_names=LOOPBACK_DNS, ip_addresses=LOOPBACK_IPS
    )
    async with production_broker(federation, {"broker": server}, acl, tmp_path / "mqtt") as running:
        yield running


async def connects(broker: MosquittoBroker, federation: Federation, who: Principal) -> bool:
    """Whether the broker lets ``who`` in (connect, subscribe, disconnect)."""
    client = aiomqtt.Client(
        broker.host,
        broker.port,
        identifier=mqtt_username(who.identity),
        tls_context=who.client_context(federation.bundle()),
        # A refused handshake shows only as a CONNACK that never comes.
        timeout=3,
    )
    try:
        async with client:
            await client.subscribe(TOPICS.region_status(who.identity.name), qos=1)
    except aiomqtt.MqttError:
        return False
    return True


async def revoke_at_the_broker(
    broker: MosquittoBroker, federation: Federation, old: Principal
) -> None:
    """``geofed ca revoke`` with the CA's CRL into the broker's crlfile, then SIGHUP."""
    ca_dir = federation.root / "org"
    crlfile = broker.config_file.parent / "crl.pem"
    argv = ["ca", "revoke", "--bundle", str(federation.bundle_file), "--cert", str(old.cert_file)]
    assert main([*argv, "--ca", str(ca_dir), "--crl", str(crlfile)]) == 0
    os.kill(broker.pid, signal.SIGHUP)
    await asyncio.sleep(0.5)  # Mosquitto reloads between two passes of its loop


async def test_a_revoked_certificate_is_refused_after_a_reload(
    broker: MosquittoBroker, federation: Federation
) -> None:
    old, new = federation.region("eu-west"), federation.region("eu-west")
    watcher = federation.observer("watch")
    assert await connects(broker, federation, old)
    assert await connects(broker, federation, new)

    await revoke_at_the_broker(broker, federation, old)

    assert not await connects(broker, federation, old)
    assert await connects(broker, federation, new)
    assert await connects(broker, federation, watcher)


async def test_a_revoked_certificate_cannot_knock_the_live_agent_off(
    broker: MosquittoBroker, federation: Federation
) -> None:
    old, new = federation.region("eu-west"), federation.region("eu-west")
    await revoke_at_the_broker(broker, federation, old)
    live = ControlClient(
        broker.host,
        broker.port,
        client_id=mqtt_username(new.identity),
        tls=new.client_context(federation.bundle()),
        timeout_s=5.0,
    )
    task = asyncio.create_task(live.run())
    try:
        await asyncio.wait_for(live.connected.wait(), 10)
        assert not await connects(broker, federation, old)
        # Still the first connection: the refused one never reached the session.
        assert live.connected.is_set()
        assert live.reconnects == 0
    finally:
        await live.close()
        await asyncio.wait_for(task, 10)
