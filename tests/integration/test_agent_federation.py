"""Two real agents and a real coordinator train a job end to end over loopback.

The embedded MQTT broker runs in the test's event loop, the coordinator is served in it
on an ephemeral port with real TLS (``tests/support/coordinator.py``),
and each agent is a ``python -m geofed_cli agent`` subprocess with its own worker group
(one gloo rank, the tiny task). The test watches the regions' retained statuses and the
round announcements, submits a three-round job as an operator, kills one agent after
its first delivery and starts it again, drains the other at the end, and checks that
both regions trained every round from the parameters the coordinator announced.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from geofed.control import (
    Command,
    ControlClient,
    RegionStatus,
    RoundAnnouncement,
    Topics,
    decode_any,
    encode,
)
from geofed.control.broker import EmbeddedBroker
from geofed.training_config import LrSchedule, TrainingConfig
from tests.support.coordinator import (
    DATASETS,
    FEDERATION,
    HTTP_TIMEOUT,
    POLICIES,
    Setup,
    coordinator,
    job_yaml,
    write_setup,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
REGIONS = ("eu-west", "us-east")
JOB = "tiny"
# Carried to the regions by every announcement; each delta's manifest must record it,
# or the coordinator refuses the delta.
TRAINING = TrainingConfig(
    grad_clip_norm=1.0,
    lr_schedule=LrSchedule(kind="warmup_cosine", warmup_steps=2, min_lr_ratio=0.5),
)
TRAINING_YAML = (
    "training: {grad_clip_norm: 1.0, "
    "lr_schedule: {kind: warmup_cosine, warmup_steps: 2, min_lr_ratio: 0.5}}\n"
)
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
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        #: region -> more lines of its agent's config file
        self.extra: dict[str, str] = {}

    async def start(self, region: str) -> None:
        config = agent_config(self.setup, region, self.port, self.extra.get(region, ""))
        with (self.setup.root / f"agent-{region}.log").open("ab") as log:
            self.procs[region] = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "geofed_cli",
                "agent",
                "--config",
                str(config),
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                stdout=log,
                stderr=subprocess.STDOUT,
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


async def test_two_agents_train_a_job_through_an_agent_crash(tmp_path: Path) -> None:
    async with EmbeddedBroker(port=0) as broker:
        setup = write_setup(tmp_path, broker.port, timeouts=TIMEOUTS)
        watcher = ControlWatcher(broker.port)
        await watcher.start()
        try:
            async with coordinator(setup) as running, agents(setup, running.port) as group:

                def ready() -> bool:
                    latest = [watcher.latest(r) for r in REGIONS]
                    return all(s is not None and s.detail == "ready" for s in latest)

                await watcher.until(ready, 90, "both agents to start their worker groups")
                operator = running.session(setup.operator)
                spec = job_yaml(JOB, rounds=3, extra=TRAINING_YAML)
                async with operator.post("/v1/jobs", data=spec.encode()) as answer:
                    assert answer.status == 201, await answer.text()

                # us-east dies (SIGKILL: no goodbye) right after delivering round 0, and
                # comes back: the broker publishes its Last Will, the old worker group stops
                # (its launcher gets the parent-death signal; the new agent reaps whatever
                # is left), the new agent resumes from its state directory and joins
                # round 1 before the deadline.
                await watcher.until(lambda: delivered(watcher, "us-east", 0), 60, "round 0")
                group.procs["us-east"].kill()
                assert await group.procs["us-east"].wait() == -signal.SIGKILL
                await watcher.until(
                    lambda: (s := watcher.latest("us-east")) is not None and s.state == "offline",
                    10,
                    "the Last Will of the killed agent",
                )
                await group.start("us-east")

                await watcher.until(
                    lambda: all(delivered(watcher, r, 2) for r in REGIONS),
                    90,
                    "both regions to deliver round 2",
                )
                async with asyncio.timeout(30):
                    while True:
                        async with operator.get(f"/v1/jobs/{JOB}", timeout=HTTP_TIMEOUT) as answer:
                            job = await answer.json()
                        if job["state"] != "running":
                            break
                        await asyncio.sleep(0.2)
                # A drained agent finishes what it does and exits 0 on its own.
                drain = Command(action="drain", reason="maintenance")
                topic = Topics(FEDERATION).region_commands("eu-west")
                await watcher.client.publish(topic, encode(drain))
                assert await asyncio.wait_for(group.procs["eu-west"].wait(), 30) == 0
                assert group.procs["us-east"].returncode is None
                restarted_log = group.log("us-east")
            await watcher.until(
                lambda: all(s.state == "offline" for s in map(watcher.latest, REGIONS) if s),
                10,
                "the agents' offline goodbye",
            )
        finally:
            await watcher.stop()

    # A group of its own: the old one stopped by itself or was reaped at this start.
    assert restarted_log.count("started worker group launch") >= 2
    announced = {
        a.round: a.base_hash for a in watcher.announcements if a.job == JOB and a.state == "open"
    }
    assert sorted(announced) == [0, 1, 2]
    opened = [a for a in watcher.announcements if a.job == JOB and a.state == "open"]
    assert {(a.training, a.total_rounds) for a in opened} == {(TRAINING, 3)}
    for round_ in announced:
        seen = {
            region: {
                s.params_hash
                for s in watcher.statuses
                if s.region == region and s.job == JOB and s.round == round_ and s.params_hash
            }
            for region in REGIONS
        }
        # Each region trained round r from exactly the θ_r the coordinator announced.
        assert seen == {region: {announced[round_]} for region in REGIONS}, (round_, seen)
    losses = [s.train_loss for s in watcher.statuses if s.job == JOB and s.train_loss is not None]
    assert losses
    assert job["state"] == "completed"
    assert job["round"] == 3
    assert [s for s in watcher.statuses if s.state == "error"] == []
