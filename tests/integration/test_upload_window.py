"""Windowed uploads against a real coordinator: chunks in flight together, commits shared,
and every chunk answered 2xx durable across a ``kill -9`` of the coordinator.

The first test serves a coordinator in-process (real TLS, real SQLite, the embedded
broker) behind the WAN proxy (20 ms each way) and uploads a spooled delta of ~90 frames
with the agent's :class:`~regional_agent.transfer.uploader.Uploader`: with window 1 it uses one
keep-alive connection and one commit per frame; with window 4 several connections carry
frames at once and concurrent frames share commits. The second runs the coordinator as a
process, sends frames 8 at a time, kills it with SIGKILL as soon as some are answered,
restarts it, and checks that every answered frame is among those the manifest step says
it holds, then that the upload completes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from coordinator.api.keys import UPLOADS
from geofed.codec import ErrorFeedback
from geofed.control.broker import EmbeddedBroker
from geofed.pki.httpauth import VerifiedConnector
from geofed.ports import unused_port
from geofed.timeouts import Timeouts
from geofed.types import Role
from geofed_cli.demo.processes import ChildSet
from regional_agent.state import DeltaMeta, JobDirectory
from regional_agent.transfer.coordinator_client import CoordinatorClient
from regional_agent.transfer.uploader import Uploader
from tests.support.coordinator import (
    HTTP_TIMEOUT,
    JOB,
    Announcements,
    FakeRegion,
    Setup,
    coordinator,
    job_yaml,
    request,
    write_setup,
)
from tests.support.fork_server import shared_fork_server
from tests.support.tiny_task import TinyOptions, TinyTask
from tests.support.wanproxy import LinkSettings, WanProxy

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
HIDDEN = 256  # ~2,800 parameters: about 90 frames of 32 elements
REGION = "eu-west"
WAIT_S = 60.0


def _job() -> str:
    return job_yaml().replace("{hidden: 8}", f"{{hidden: {HIDDEN}}}")


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    model = TinyTask(TinyOptions(hidden=HIDDEN)).build_model(seed=0)
    gen = torch.Generator().manual_seed(seed)
    return {
        name: 0.01 * torch.randn(p.shape, generator=gen) for name, p in model.state_dict().items()
    }


def _delta(region: FakeRegion, base: str, seed: int) -> tuple[bytes, list[bytes]]:
    manifest, stream = region.delta(
        JOB, 0, base, seed=seed, chunk_elements=32, tensors=_tensors(seed)
    )
    frames = list(stream.frames())
    assert len(frames) >= 60
    return manifest, frames


def _session(setup: Setup, name: str) -> aiohttp.ClientSession:
    bundle = setup.bundle
    principal = setup.regions[name]
    connector = VerifiedConnector(
        bundle, principal.client_context(bundle()), expect=Role.COORDINATOR
    )
    return aiohttp.ClientSession(connector=connector, timeout=HTTP_TIMEOUT)


@pytest.mark.parametrize("window", [1, 4])
async def test_chunks_travel_together_and_share_commits(tmp_path: Path, window: int) -> None:
    async with EmbeddedBroker() as broker, Announcements(broker.port) as announcements:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            status, body = await request(operator, "POST", "/v1/jobs", data=_job())
            assert status == 201, body
            base = (await announcements.until(round=0, state="open")).base_hash
            manifest, frames = _delta(running.region(REGION), base, seed=1)
            spooled = JobDirectory(tmp_path / "agent", JOB).write_spool(
                0, manifest, frames, ErrorFeedback(), DeltaMeta(0.5, 100, base)
            )
            chunks = running.runner.app[UPLOADS].chunks
            before = chunks.stats.commits, chunks.stats.items
            link = LinkSettings(latency_s=0.02)
            async with (
                WanProxy(
                    "127.0.0.1",
                    0,
                    "127.0.0.1",
                    running.port,
                    seed=1,
                    upstream=link,
                    downstream=link,
                ) as wan,
                _session(setup, REGION) as session,
            ):
                client = CoordinatorClient(
                    session,
                    f"https://localhost:{wan.port}",
                    Timeouts(connect_s=5, heartbeat_s=1, request_s=10, upload_s=50),
                )
                report = await Uploader(client, REGION, window=window).upload(
                    JOB, spooled, {"train_loss": 0.5}
                )
                connections = wan.stats().connections_accepted
            commits = chunks.stats.commits - before[0]
            items = chunks.stats.items - before[1]

    assert report.receipt["region"] == REGION
    assert report.chunks_sent == items == len(frames)
    assert report.attempts == 1
    if window == 1:
        # One keep-alive connection, one frame at a time: one commit each.
        assert connections == 1
        assert commits == len(frames)
    else:
        # Frames went over several connections at once, and concurrent ones shared commits.
        assert 2 <= connections <= window
        assert commits < len(frames)
        assert chunks.stats.largest >= 2


class _Coordinator:
    """A coordinator process on a fixed port that can be killed and restarted."""

    def __init__(self, setup: Setup, children: ChildSet, port: int) -> None:
        self.setup = setup
        self.children = children
        self.port = port
        self.sessions: list[aiohttp.ClientSession] = []

    def session(self, name: str | None = None) -> aiohttp.ClientSession:
        bundle = self.setup.bundle
        principal = self.setup.regions[name] if name else self.setup.operator
        connector = VerifiedConnector(
            bundle, principal.client_context(bundle()), expect=Role.COORDINATOR
        )
        session = aiohttp.ClientSession(
            base_url=f"https://localhost:{self.port}", connector=connector, timeout=HTTP_TIMEOUT
        )
        self.sessions.append(session)
        return session

    async def start(self) -> None:
        self.children.env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        args = ["coordinator", "--config", str(self.setup.config_path)]
        child = await self.children.start("coordinator", args)
        deadline = time.monotonic() + WAIT_S
        observer = self.session()
        while time.monotonic() < deadline:
            self.children.check_alive()
            try:
                if (await request(observer, "GET", "/readyz"))[0] == 200:
                    return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
        raise AssertionError(f"coordinator not ready:\n{child.log_tail(40)}")

    def kill(self) -> None:
        child = self.children.children[-1]
        assert child.pid is not None
        os.killpg(child.pid, signal.SIGKILL)

    async def reap(self) -> None:
        child = self.children.children.pop()
        await child.stop(10.0)
        assert child.returncode == -signal.SIGKILL
        await self.close()

    async def close(self) -> None:
        for session in self.sessions:
            await session.close()
        self.sessions.clear()

    async def job(self) -> dict[str, Any]:
        status, body = await request(self.session(), "GET", f"/v1/jobs/{JOB}")
        assert status == 200, body
        return body


@pytest.mark.slow
async def test_every_answered_chunk_survives_a_coordinator_kill(tmp_path: Path) -> None:
    async with (
        EmbeddedBroker() as broker,
        ChildSet(tmp_path / "logs", fork_server=await shared_fork_server()) as children,
    ):
        setup = write_setup(tmp_path, broker.port)
        port = unused_port()
        text = setup.config_path.read_text()
        setup.config_path.write_text(text.replace("port: 0}", f"port: {port}}}"))
        daemon = _Coordinator(setup, children, port)
        try:
            await daemon.start()
            status, body = await request(daemon.session(), "POST", "/v1/jobs", data=_job())
            assert status == 201, body
            deadline = time.monotonic() + WAIT_S
            while (job := await daemon.job()).get("current", {}).get("phase") != "collecting":
                assert time.monotonic() < deadline, job
                await asyncio.sleep(0.1)
            region = FakeRegion(setup.regions[REGION], daemon.session(REGION), setup.bundle)
            manifest, frames = _delta(region, job["params_hash"], seed=2)
            path = region.path(JOB, 0)
            status, body = await request(region.session, "PUT", path + "/manifest", data=manifest)
            assert (status, body["received"]) == (200, []), body

            # Frames 8 at a time; the coordinator dies as soon as 12 are answered.
            answered: set[int] = set()
            enough = asyncio.Event()
            slots = asyncio.Semaphore(8)

            async def put(index: int) -> None:
                async with slots:
                    if enough.is_set():
                        return
                    url = f"{path}/chunks/{index}"
                    async with region.session.put(url, data=frames[index]) as response:
                        await response.read()
                        if response.status == 200:
                            answered.add(index)
                            if len(answered) >= 12:
                                enough.set()
                                daemon.kill()

            await asyncio.gather(*(put(i) for i in range(len(frames))), return_exceptions=True)
            assert enough.is_set()
            acknowledged = set(answered)
            await daemon.reap()

            await daemon.start()
            region = FakeRegion(setup.regions[REGION], daemon.session(REGION), setup.bundle)
            status, body = await request(region.session, "PUT", path + "/manifest", data=manifest)
            assert status == 200, body
            held = set(body["received"])
            assert acknowledged <= held, sorted(acknowledged - held)
            for index in sorted(set(range(len(frames))) - held):
                status, body = await request(
                    region.session, "PUT", f"{path}/chunks/{index}", data=frames[index]
                )
                assert status == 200, body
            # The commit re-reads every spooled frame against its hash: the held ones are whole.
            status, body = await request(
                region.session, "POST", path + "/commit", json={"metrics": {"train_loss": 1.0}}
            )
            assert (status, body["state"]) == (200, "accepted"), body
        finally:
            await daemon.close()
