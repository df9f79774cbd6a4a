"""Regional agents as real processes beside an in-process coordinator: their configs,
a watcher of the control topics, and what a delivered round looks like (shared by the
agent federation tests). The agents are forked from this test process's fork server
(:mod:`tests.support.fork_server`)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from geofed.control import ControlClient, RegionStatus, RoundAnnouncement, Topics, decode_any
from geofed_cli.demo.fork_client import ForkedProcess
from tests.support.coordinator import DATASETS, FEDERATION, POLICIES, Setup
from tests.support.fork_server import shared_fork_server

REPO = Path(__file__).resolve().parents[2]
REGIONS = ("eu-west", "us-east")
JOB = "tiny"

TIMEOUTS = (
    "{connect_s: 1, heartbeat_s: 0.5, request_s: 2, upload_s: 5, download_s: 5, "
    "round_deadline_s: 30}"
)


class ControlWatcher:
    """Every status and announcement published on the federation's topics, in order."""

    def __init__(self, port: int) -> None:
        self.client = ControlClient("127.0.0.1", port, client_id="test-agent-watcher")
        self.statuses: list[RegionStatus] = []
        self.announcements: list[RoundAnnouncement] = []
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    async def _on_message(self, topic: str, payload: bytes) -> None:
        message = decode_any(payload)
        if isinstance(message, RegionStatus):
            self.statuses.append(message)
        elif isinstance(message, RoundAnnouncement):
            self.announcements.append(message)
        async with self._changed:
            self._changed.notify_all()

    async def until(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        try:
            async with asyncio.timeout(timeout_s), self._changed:
                await self._changed.wait_for(predicate)
        except TimeoutError:
            seen = [(s.region, s.state, s.round, s.detail) for s in self.statuses[-8:]]
            raise AssertionError(f"timed out waiting for {what}; last statuses {seen}") from None

    def latest(self, region: str) -> RegionStatus | None:
        found = [s for s in self.statuses if s.region == region]
        return found[-1] if found else None

    async def start(self) -> None:
        topics = Topics(FEDERATION)
        await self.client.subscribe(topics.all_region_status(), self._on_message)
        await self.client.subscribe(topics.all_job_rounds(), self._on_message)
        self._task = asyncio.create_task(self.client.run())
        await self.client.wait_connected(5.0)

    async def stop(self) -> None:
        await self.client.close(timeout_s=5.0)
        if self._task is not None:
            await asyncio.wait([self._task])


def agent_config(setup: Setup, region: str, coordinator_port: int, extra: str = "") -> Path:
    principal = setup.regions[region]
    path = setup.root / f"agent-{region}.yaml"
    path.write_text(
        f"""\
federation: {FEDERATION}
region: {region}
policy: {POLICIES / f"{region}.yaml"}
datasets: {DATASETS[region]}
coordinator_url: https://localhost:{coordinator_port}
mqtt: {{host: 127.0.0.1, port: {setup.broker_port}, tls: false}}
identity:
  cert: {principal.cert_file}
  key: {principal.key_file}
  trust_bundle: {setup.fed.bundle_file}
workers: {{count: 1, backend: gloo, start_timeout_s: 120}}
metrics: {{host: 127.0.0.1, port: 0}}
state_dir: {setup.root / "agents" / region}
timeouts: {TIMEOUTS}
{extra}"""
    )
    return path


class Agents:
    """The agent processes of the test, one per region, logging to files."""

    def __init__(self, setup: Setup, coordinator_port: int) -> None:
        self.setup = setup
        self.port = coordinator_port
        self.procs: dict[str, ForkedProcess] = {}
        #: region -> more lines of its agent's config file
        self.extra: dict[str, str] = {}

    async def start(self, region: str) -> None:
        config = agent_config(self.setup, region, self.port, self.extra.get(region, ""))
        server = await shared_fork_server()
        self.procs[region] = await asyncio.to_thread(
            server.spawn,
            ["agent", "--config", str(config)],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            cwd=REPO,
            log_file=self.setup.root / f"agent-{region}.log",
        )

    def log(self, region: str) -> str:
        return (self.setup.root / f"agent-{region}.log").read_text(errors="replace")


@asynccontextmanager
async def agents(
    setup: Setup, coordinator_port: int, extra: dict[str, str] | None = None
) -> AsyncIterator[Agents]:
    """Start one agent per region; on exit SIGTERM those still running, check they exit 0.

    ``extra``: region -> more lines of its agent's config file.
    """
    group = Agents(setup, coordinator_port)
    group.extra.update(extra or {})
    try:
        for region in REGIONS:
            await group.start(region)
        yield group
    finally:
        for proc in group.procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for region, proc in group.procs.items():
            try:
                codes[region] = await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
                codes[region] = None
        for region, code in codes.items():
            if code != 0:
                print(f"--- agent {region} exited {code} ---\n{group.log(region)[-6000:]}")
        assert codes == dict.fromkeys(REGIONS, 0)


def delivered(watcher: ControlWatcher, region: str, round_: int) -> bool:
    status = watcher.latest(region)
    return (
        status is not None
        and status.job == JOB
        and status.round == round_
        and status.state == "online"
        and status.detail.startswith("delta accepted")
    )
