"""A region whose GPU starts counting uncorrectable memory errors gets its job snapshotted
at once, a regional checkpoint asked of it, and then drained, with the real coordinator,
over MQTT and HTTPS.

The job snapshots every 2 rounds, so θ_1 is normally not snapshotted. eu-west's status
reports its node; between its first status and round 0's publication it reports two new
uncorrectable ECC errors: the hardware risk passes 0.7, round 0's publication snapshots
θ_1, eu-west (only) gets a ``checkpoint`` command from round 1 on, and the job's status
gives the risk and why. Two errors more before round 1's publication take the risk
past the drain threshold (0.9): eu-west is sent a ``drain`` command.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from coordinator.storage.checkpoints import CheckpointStore
from geofed.control import (
    Command,
    ControlClient,
    HardwareSummary,
    RegionStatus,
    Topics,
    encode,
)
from geofed.control.broker import EmbeddedBroker
from tests.support.coordinator import (
    Announcements,
    Running,
    Subscribed,
    coordinator,
    job_yaml,
    request,
    write_setup,
)

pytestmark = pytest.mark.integration


async def report(port: int, ecc: int) -> None:
    """eu-west's agent says its node has ``ecc`` uncorrectable ECC errors over its life."""
    client = ControlClient("127.0.0.1", port, client_id="eu-west-agent", timeout_s=5.0)
    task = asyncio.create_task(client.run())
    hardware = HardwareSummary(host="gpu-node-1", gpus=8, ecc_uncorrected=ecc)
    status = RegionStatus(region="eu-west", state="online", agent_version="t", hardware=hardware)
    await client.publish(Topics("acme").region_status("eu-west"), encode(status), retain=True)
    await client.close(timeout_s=5.0)
    await asyncio.wait([task])


async def seen(running: Running, ecc: int) -> None:
    observer = running.session(running.setup.observer)
    deadline = time.monotonic() + 20
    regions: list[Any] = []
    while time.monotonic() < deadline:
        _, body = await request(observer, "GET", "/v1/regions")
        regions = body["regions"]
        eu = next(r for r in regions if r["region"] == "eu-west")
        if (eu.get("hardware") or {}).get("ecc_uncorrected") == ecc:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the coordinator never saw {ecc} ECC errors: {regions}")


async def deliver(running: Running, round_: int, base: str) -> None:
    for index, name in enumerate(("eu-west", "us-east")):
        region = running.region(name)
        manifest, stream = region.delta("tiny", round_, base, seed=10 * round_ + index, tokens=100)
        status, body = await region.three_step("tiny", round_, manifest, stream)
        assert (status, body["state"]) == (200, "accepted"), body


async def test_new_uncorrectable_errors_get_the_job_snapshotted_at_once(tmp_path: Any) -> None:
    async with (
        EmbeddedBroker() as broker,
        Announcements(broker.port) as announcements,
        Subscribed(
            broker.port, Topics("acme").region_commands("eu-west"), Command, "eu-west-commands"
        ) as commands,
    ):
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            await report(broker.port, ecc=0)
            await seen(running, 0)
            operator = running.session(setup.operator)
            status, body = await request(operator, "POST", "/v1/jobs", data=job_yaml(rounds=3))
            assert status == 201, body
            first = await announcements.until(round=0, state="open")
            _, job = await request(operator, "GET", "/v1/jobs/tiny")
            assert job["snapshot"]["risk"] == {
                "score": 0.0,
                "reason": "eu-west: no sign of trouble",
            }

            await report(broker.port, ecc=2)
            await seen(running, 2)
            await deliver(running, 0, first.base_hash)
            second = await announcements.until(round=1, state="open")
            _, job = await request(operator, "GET", "/v1/jobs/tiny")
            risk = job["snapshot"]["risk"]
            assert risk["score"] == pytest.approx(0.85)
            assert risk["reason"] == "eu-west: 2 new uncorrectable ECC error(s) (0.85)"
            ask = await asyncio.wait_for(commands.queue.get(), timeout=10)
            assert (ask.action, ask.job, ask.round) == ("checkpoint", "tiny", 1)
            assert commands.queue.empty(), "0.85 is below the drain threshold"

            await report(broker.port, ecc=4)
            await seen(running, 4)
            await deliver(running, 1, second.base_hash)
            await announcements.until(round=2, state="open")
            # The risk rose by 0.1 more: another snapshot, another ask, then the drain.
            again = await asyncio.wait_for(commands.queue.get(), timeout=10)
            assert (again.action, again.round) == ("checkpoint", 2)
            drain = await asyncio.wait_for(commands.queue.get(), timeout=10)
            assert (drain.action, drain.job) == ("drain", "tiny")
            assert drain.reason == (
                "hardware risk 0.95 reached 0.9: 4 new uncorrectable ECC error(s) (0.95)"
            )

        store = CheckpointStore("eu-ckpt", tmp_path / "ckpt" / "eu")
        snapshots = [e.round for e in store.entries("tiny") if e.kind.value == "snapshot"]
        # θ_0, θ_1 for the risk (not a multiple of 2), θ_2 by the interval.
        assert snapshots == [0, 1, 2], snapshots
