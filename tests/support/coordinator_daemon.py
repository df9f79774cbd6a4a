"""Coordinator daemons as real processes, fed fixed deltas by test code acting as regions.

A :class:`Daemon` is one coordinator configuration (``tests/support/coordinator.py``
:func:`write_setup`, Mosquitto with mutual TLS) run as a process that a test may start
(armed with a :mod:`coordinator.faults` point or not), kill with SIGKILL and restart.
Its two regions upload deterministic deltas (FakeRegion: fixed seeds and token counts),
so two runs of the same job publish the same bits: :func:`run_reference` runs the job
uninterrupted and returns its :class:`Outcome` for a faulted run to be compared with.
:func:`lease_pair` gives two daemons sharing one PostgreSQL state and a leader lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from coordinator.faults import FAULT_ENV
from coordinator.state.audit import AuditEntry
from geofed.artifact_bundle import split_bundle
from geofed.pki.httpauth import VerifiedConnector
from geofed.ports import unused_port
from geofed.types import Role
from geofed_cli.demo.processes import Child, ChildSet
from tests.support.coordinator import (
    HTTP_TIMEOUT,
    FakeRegion,
    Setup,
    job_yaml,
    request,
    write_setup,
)
from tests.support.fork_server import shared_fork_server
from tests.support.mosquitto import run_mosquitto
from tests.support.pki import Federation, Principal

REPO = Path(__file__).resolve().parents[2]
JOB = "tiny"
ROUNDS = 3
REGIONS = ("eu-west", "us-east")
WAIT_S = 60.0


@dataclass
class Daemon:
    """One coordinator's configuration, run as a process that may be killed and restarted."""

    setup: Setup
    children: ChildSet
    port: int
    child: Child | None = None
    #: The child process's name (its log is ``<name>.log``).
    name: str = "coordinator"
    sessions: dict[str, aiohttp.ClientSession] = field(default_factory=dict)

    @property
    def state_dir(self) -> Path:
        return self.setup.root / "state"

    def session(self, principal: Principal) -> aiohttp.ClientSession:
        """A client session presenting ``principal``'s certificate (one per process)."""
        key = principal.identity.uri
        if key not in self.sessions:
            bundle = self.setup.bundle
            connector = VerifiedConnector(
                bundle, principal.client_context(bundle()), expect=Role.COORDINATOR
            )
            self.sessions[key] = aiohttp.ClientSession(
                base_url=f"https://localhost:{self.port}",
                connector=connector,
                timeout=HTTP_TIMEOUT,
            )
        return self.sessions[key]

    def region(self, name: str) -> FakeRegion:
        principal = self.setup.regions[name]
        return FakeRegion(principal, self.session(principal), self.setup.bundle)

    async def start(self, fault: str | None = None, *, wait_ready: bool = True) -> None:
        """Start the process (armed with ``fault``), by default until it is ready."""
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        env.pop(FAULT_ENV, None)
        if fault is not None:
            env[FAULT_ENV] = fault
        self.children.env = env
        args = ["coordinator", "--config", str(self.setup.config_path)]
        self.child = await self.children.start(self.name, args)
        if wait_ready:
            await self.wait_ready()

    async def wait_ready(self, timeout_s: float = WAIT_S) -> float:
        """Until ``/readyz`` answers 200; how long that took."""
        observer = self.session(self.setup.observer)
        started = time.monotonic()
        deadline = started + timeout_s
        while time.monotonic() < deadline:
            self.children.check_alive()
            try:
                if (await request(observer, "GET", "/readyz"))[0] == 200:
                    return time.monotonic() - started
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        tail = self.child.log_tail(40) if self.child else ""
        raise AssertionError(f"{self.name} not ready within {timeout_s} s:\n{tail}")

    async def kill(self) -> None:
        """SIGKILL the process, then forget it (and the sessions that talked to it)."""
        child = self.child
        assert child is not None
        assert child.pid is not None
        os.killpg(child.pid, signal.SIGKILL)
        await child.stop(10.0)
        assert child.returncode == -signal.SIGKILL
        await self.forget()

    async def forget(self) -> None:
        """Forget a process that has exited (and the sessions that talked to it)."""
        if self.child is not None:
            self.children.children.remove(self.child)
            self.child = None
        await self.close_sessions()

    async def close_sessions(self) -> None:
        for session in self.sessions.values():
            await session.close()
        self.sessions.clear()

    async def job(self) -> dict[str, Any]:
        status, body = await request(self.session(self.setup.operator), "GET", f"/v1/jobs/{JOB}")
        assert status == 200, body
        return body

    async def wait_job(self, what: str, predicate: Any) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_S
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            assert self.child is not None
            self.children.check_alive()
            last = await self.job()
            if predicate(last):
                return last
            await asyncio.sleep(0.1)
        log = self.child.log_tail(40) if self.child else ""
        raise AssertionError(f"timed out waiting for {what}; last status {last}\n{log}")

    async def wait_marker(self, phase: str, round_: int) -> None:
        marker = self.state_dir / f"fault-{phase}-{JOB}-{round_}"
        deadline = time.monotonic() + WAIT_S
        while not marker.exists():
            assert self.child is not None
            self.children.check_alive()
            assert time.monotonic() < deadline, f"no {marker}:\n{self.child.log_tail(40)}"
            await asyncio.sleep(0.05)

    async def submit(self) -> None:
        operator = self.session(self.setup.operator)
        status, body = await request(operator, "POST", "/v1/jobs", data=job_yaml(rounds=ROUNDS))
        assert status == 201, body

    async def deliver(self, round_: int) -> None:
        """Both regions upload their fixed deltas for ``round_`` (which must be collecting)."""
        job = await self.wait_job(
            f"round {round_} to collect",
            lambda s: s["round"] == round_ and s.get("current", {}).get("phase") == "collecting",
        )
        for index, name in enumerate(REGIONS):
            region = self.region(name)
            base, seed, tokens = job["params_hash"], 1000 * round_ + index, 100 + 200 * index
            manifest, stream = region.delta(JOB, round_, base, seed=seed, tokens=tokens)
            status, body = await region.three_step(JOB, round_, manifest, stream)
            assert (status, body["state"]) == (200, "accepted"), body

    async def wait_published(self, round_: int) -> dict[str, Any]:
        return await self.wait_job(f"round {round_} published", lambda s: s["round"] > round_)

    async def update_stream(self, round_: int) -> tuple[bytes, str]:
        """Round ``round_``'s published update: its codec stream, and θ_{round_+1}'s hash."""
        region = self.region(REGIONS[0])
        _, parameters_hash = await region.download_update(JOB, round_)  # verifies it
        async with region.session.get(f"/v1/jobs/{JOB}/rounds/{round_}/update") as response:
            assert response.status == 200
            _, stream = split_bundle(await response.read())
        return stream, parameters_hash

    async def audit(self) -> list[AuditEntry]:
        observer = self.session(self.setup.observer)
        status, body = await request(observer, "GET", f"/v1/audit?job={JOB}&limit=1000&verify=1")
        assert status == 200, body
        assert body["verify"]["ok"], body["verify"]
        return [AuditEntry.from_dict(entry) for entry in body["entries"]]


@dataclass(frozen=True)
class Outcome:
    """What a run published: per round the update stream and θ_{r+1}'s hash, and the end."""

    updates: dict[int, tuple[bytes, str]]
    final_hash: str
    checkpoint_hash: str
    checkpoint_round: int


async def outcome(daemon: Daemon) -> Outcome:
    job = await daemon.wait_job("the job to complete", lambda s: s["state"] == "completed")
    assert job["round"] == ROUNDS
    updates = {r: await daemon.update_stream(r) for r in range(ROUNDS)}
    _, checkpoint_hash, checkpoint_round = await daemon.region(REGIONS[1]).download_params(JOB)
    return Outcome(updates, job["params_hash"], checkpoint_hash, checkpoint_round)


@asynccontextmanager
async def daemon_with_broker(root: Path, fed: Federation) -> AsyncIterator[Daemon]:
    server = fed.coordinator("broker")
    with run_mosquitto(
        root / "mqtt", cafile=fed.ca_file, certfile=server.cert_file, keyfile=server.key_file
    ) as broker:
        async with served(root, fed, broker.port) as daemon:
            yield daemon


@asynccontextmanager
async def served(root: Path, fed: Federation, broker_port: int) -> AsyncIterator[Daemon]:
    async with ChildSet(
        root / "logs", stop_deadline_s=20, fork_server=await shared_fork_server()
    ) as kids:
        setup = write_setup(root, broker_port, mqtt_tls=True, fed=fed)
        port = unused_port()
        text = setup.config_path.read_text()
        setup.config_path.write_text(text.replace("port: 0}", f"port: {port}}}"))
        daemon = Daemon(setup, kids, port)
        try:
            yield daemon
        finally:
            await daemon.close_sessions()


async def run_reference(root: Path, fed: Federation) -> Outcome:
    async with daemon_with_broker(root, fed) as daemon:
        await daemon.start()
        await daemon.submit()
        for round_ in range(ROUNDS):
            await daemon.deliver(round_)
            await daemon.wait_published(round_)
        return await outcome(daemon)


@asynccontextmanager
async def lease_pair(
    root: Path, fed: Federation, dsn: str, ttl_s: float
) -> AsyncIterator[tuple[Daemon, Daemon]]:
    """Coordinators A and B sharing a leader lease of ``ttl_s`` on the database ``dsn``:
    one federation, broker and state directory (standing for a shared filesystem).

    Started by the caller; a process frozen with SIGSTOP is let go before they stop.
    """
    server = fed.coordinator("broker")
    with run_mosquitto(
        root / "mqtt", cafile=fed.ca_file, certfile=server.cert_file, keyfile=server.key_file
    ) as broker:
        async with ChildSet(
            root / "logs", stop_deadline_s=20, fork_server=await shared_fork_server()
        ) as kids:
            setup = write_setup(root, broker.port, mqtt_tls=True, fed=fed)
            text = setup.config_path.read_text() + (
                f"state_store: {{kind: postgresql, dsn: '{dsn}', "
                f"leader_lease: {{ttl_s: {ttl_s}}}}}\n"
            )
            daemons = []
            for name in ("coordinator-a", "coordinator-b"):
                # Each its own port: a frozen leader keeps its socket, as on its own machine.
                port = unused_port()
                path = root / f"{name}.yaml"  # beside coordinator.yaml: the same state_dir
                path.write_text(text.replace("port: 0}", f"port: {port}}}"))
                daemons.append(Daemon(replace(setup, config_path=path), kids, port, name=name))
            try:
                yield daemons[0], daemons[1]
            finally:
                for daemon in daemons:
                    if daemon.child is not None and daemon.child.returncode is None:
                        with contextlib.suppress(ProcessLookupError):
                            signal_group(daemon, signal.SIGCONT)  # a frozen one must stop
                    await daemon.close_sessions()


def signal_group(daemon: Daemon, sig: signal.Signals) -> None:
    """Send ``sig`` to the daemon's process group."""
    assert daemon.child is not None
    assert daemon.child.pid is not None
    os.killpg(daemon.child.pid, sig)


def log_text(daemon: Daemon) -> str:
    """Everything the daemon's processes have logged."""
    return (daemon.setup.root / "logs" / f"{daemon.name}.log").read_text(errors="replace")


async def standing_by(daemon: Daemon, before: int) -> None:
    """Until ``daemon``'s log says, after its first ``before`` characters, that it waits."""
    deadline = time.monotonic() + WAIT_S
    while "standby:" not in log_text(daemon)[before:]:
        daemon.children.check_alive()
        assert time.monotonic() < deadline, f"{daemon.name} never stood by:\n{log_text(daemon)}"
        await asyncio.sleep(0.1)


async def deliver_one(daemon: Daemon, round_: int, index: int) -> None:
    """Region ``REGIONS[index]`` uploads its fixed delta for ``round_``."""
    job = await daemon.wait_job(
        f"round {round_} to collect",
        lambda s: s["round"] == round_ and s.get("current", {}).get("phase") == "collecting",
    )
    region = daemon.region(REGIONS[index])
    base, seed, tokens = job["params_hash"], 1000 * round_ + index, 100 + 200 * index
    manifest, stream = region.delta(JOB, round_, base, seed=seed, tokens=tokens)
    status, body = await region.three_step(JOB, round_, manifest, stream)
    assert (status, body["state"]) == (200, "accepted"), body
