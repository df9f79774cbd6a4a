"""The production control plane: the coordinator on Mosquitto with mutual TLS and an ACL."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from geofed.control import ControlClient, RoundAnnouncement, Topics, decode
from tests.support.coordinator import (
    FEDERATION,
    coordinator,
    job_yaml,
    request,
    write_setup,
)
from tests.support.mosquitto import run_mosquitto
from tests.support.pki import make_federation

pytestmark = pytest.mark.integration

# What `geofed mqtt acl` grants the coordinator and one region (deploy/mosquitto).
ACL = f"""\
user coordinator.main
topic readwrite geofed/{FEDERATION}/jobs/#
topic write geofed/{FEDERATION}/regions/+/commands
topic write geofed/{FEDERATION}/events
topic read geofed/{FEDERATION}/regions/+/status

user region.eu-west
topic readwrite geofed/{FEDERATION}/regions/eu-west/status
topic read geofed/{FEDERATION}/regions/eu-west/commands
topic read geofed/{FEDERATION}/jobs/+/round
topic read geofed/{FEDERATION}/events
"""


async def test_announcements_reach_regions_over_mutual_tls(tmp_path: Path) -> None:
    fed = make_federation(tmp_path / "fed", FEDERATION)
    server = fed.coordinator("broker")
    with run_mosquitto(
        tmp_path / "mqtt",
        cafile=fed.ca_file,
        certfile=server.cert_file,
        keyfile=server.key_file,
        acl=ACL,
    ) as broker:
        setup = write_setup(tmp_path, broker.port, mqtt_tls=True, fed=fed)
        region = setup.regions["eu-west"]
        received: asyncio.Queue[RoundAnnouncement] = asyncio.Queue()

        async def on_round(topic: str, payload: bytes) -> None:
            await received.put(decode(payload, RoundAnnouncement))

        agent = ControlClient(
            "127.0.0.1",
            broker.port,
            client_id="agent-eu-west",
            tls=region.client_context(fed.bundle()),
            timeout_s=5.0,
        )
        await agent.subscribe(Topics(FEDERATION).all_job_rounds(), on_round)
        task = asyncio.create_task(agent.run())
        try:
            async with coordinator(setup) as running:
                operator = running.session(setup.operator)
                async with asyncio.timeout(10):  # ready once the TLS connection is up
                    while (await request(operator, "GET", "/readyz"))[0] != 200:  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
                status, body = await request(operator, "POST", "/v1/jobs", data=job_yaml())
                assert status == 201, body
                async with asyncio.timeout(10):
                    message = await received.get()
                assert (message.job, message.round, message.state) == ("tiny", 0, "open")
        finally:
            await agent.close(timeout_s=5.0)
            await asyncio.wait([task])
