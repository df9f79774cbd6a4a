"""The coordinator killed with SIGKILL while it aggregates, and again while it publishes.

Two coordinator daemons (real processes, real TLS, real SQLite, Mosquitto with mutual
TLS) run the same three-round job, fed the same deltas by test code acting as two
regions (FakeRegion: fixed seeds, fixed token counts). The reference runs uninterrupted.
The other is armed with ``GEOFED_FAULT_PAUSE_AT`` (:mod:`coordinator.faults`): it is
killed once round 1 has closed and before anything of its publication is computed,
restarted, killed again once round 1's update, θ_2's snapshot and working state are
stored but the publishing transaction has not committed, and restarted for good.

What it proves: every round's published update stream and parameter hash, and the final
checkpoint chain, are bit for bit the reference's; round 1 is applied exactly once (one
``round.publish`` audit entry per round, two accepted deltas per round, the job's round
counter at 3); nothing uncommitted is served while the publication waits for its commit;
the reference folded every round's deltas as they were accepted, the restarted daemon
decoded round 1's again in the recorded arrival order, with the same bits.
And a fault point the coordinator does not know stops it with a configuration error.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from coordinator.audit import AuditEntry
from coordinator.checkpoints import CheckpointStore
from coordinator.faults import FAULT_ENV
from geofed.artifact_bundle import split_bundle
from geofed.pki.httpauth import VerifiedConnector
from geofed.types import Role
from geofed_cli import main
from geofed_cli.demo.processes import Child, ChildSet
from tests.support.coordinator import (
    HTTP_TIMEOUT,
    FakeRegion,
    Setup,
    job_yaml,
    request,
    write_setup,
)
from tests.support.mosquitto import run_mosquitto
from tests.support.pki import Federation, Principal, make_federation

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
JOB = "tiny"
ROUNDS = 3
KILLED_ROUND = 1
REGIONS = ("eu-west", "us-east")
WAIT_S = 60.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Daemon:
    """One coordinator's configuration, run as a process that may be killed and restarted."""

    setup: Setup
    children: ChildSet
    port: int
    child: Child | None = None
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

    async def start(self, fault: str | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        env.pop(FAULT_ENV, None)
        if fault is not None:
            env[FAULT_ENV] = fault
        self.children.env = env
        args = ["coordinator", "--config", str(self.setup.config_path)]
        self.child = await self.children.start("coordinator", args)
        observer = self.session(self.setup.observer)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            self.children.check_alive()
            try:
                if (await request(observer, "GET", "/readyz"))[0] == 200:
                    return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
        raise AssertionError(f"coordinator not ready within {WAIT_S} s:\n{self.child.log_tail(40)}")

    async def kill(self) -> None:
        """SIGKILL the process, then forget it (and the sessions that talked to it)."""
        child = self.child
        assert child is not None
        assert child.pid is not None
        os.killpg(child.pid, signal.SIGKILL)
        await child.stop(10.0)
        assert child.returncode == -signal.SIGKILL
        self.children.children.remove(child)
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


async def _outcome(daemon: Daemon) -> Outcome:
    job = await daemon.wait_job("the job to complete", lambda s: s["state"] == "completed")
    assert job["round"] == ROUNDS
    updates = {r: await daemon.update_stream(r) for r in range(ROUNDS)}
    _, checkpoint_hash, checkpoint_round = await daemon.region(REGIONS[1]).download_params(JOB)
    return Outcome(updates, job["params_hash"], checkpoint_hash, checkpoint_round)


@asynccontextmanager
async def _daemon(root: Path, fed: Federation) -> AsyncIterator[Daemon]:
    server = fed.coordinator("broker")
    with run_mosquitto(
        root / "mqtt", cafile=fed.ca_file, certfile=server.cert_file, keyfile=server.key_file
    ) as broker:
        async with _served(root, fed, broker.port) as daemon:
            yield daemon


@asynccontextmanager
async def _served(root: Path, fed: Federation, broker_port: int) -> AsyncIterator[Daemon]:
    async with ChildSet(root / "logs", stop_deadline_s=20) as kids:
        setup = write_setup(root, broker_port, mqtt_tls=True, fed=fed)
        port = _free_port()
        text = setup.config_path.read_text()
        setup.config_path.write_text(text.replace("port: 0}", f"port: {port}}}"))
        daemon = Daemon(setup, kids, port)
        try:
            yield daemon
        finally:
            await daemon.close_sessions()


async def _reference(root: Path, fed: Federation) -> Outcome:
    async with _daemon(root, fed) as daemon:
        await daemon.start()
        await daemon.submit()
        for round_ in range(ROUNDS):
            await daemon.deliver(round_)
            await daemon.wait_published(round_)
        return await _outcome(daemon)


async def test_killed_while_aggregating_and_publishing_the_round_is_bit_identical(
    tmp_path: Path,
) -> None:
    fed = make_federation(tmp_path / "fed", "acme")
    reference = await _reference(tmp_path / "reference", fed)

    async with _daemon(tmp_path / "killed", fed) as daemon:
        await daemon.start(fault=f"aggregate:{KILLED_ROUND}")
        await daemon.submit()
        await daemon.deliver(0)
        await daemon.wait_published(0)
        await daemon.deliver(KILLED_ROUND)

        # Killed while aggregating: the round is closed, nothing of it computed yet.
        await daemon.wait_marker("aggregate", KILLED_ROUND)
        job = await daemon.job()
        assert (job["round"], job["current"]["phase"]) == (KILLED_ROUND, "aggregating"), job
        await daemon.kill()

        # Killed while publishing: update and snapshot stored, the round not committed.
        restarted = time.monotonic()
        await daemon.start(fault=f"publish:{KILLED_ROUND}")
        await daemon.wait_marker("publish", KILLED_ROUND)
        job = await daemon.job()
        assert (job["round"], job["current"]["phase"]) == (KILLED_ROUND, "aggregating"), job
        region = daemon.region(REGIONS[0])
        path = f"/v1/jobs/{JOB}/rounds/{KILLED_ROUND}/update"
        status, body = await request(region.session, "GET", path)
        assert (status, body["error"]) == (404, "not_found"), body  # not published yet
        _, _, version = await region.download_params(JOB)
        assert version == KILLED_ROUND  # the chain served stops at the committed θ
        await daemon.kill()
        # What the killed publication left behind: round 1's update and θ_2's snapshot.
        store = CheckpointStore("eu-ckpt", daemon.setup.root / "ckpt" / "eu")
        recorded = [(e.kind.value, e.round) for e in store.entries(JOB)]
        assert ("update", KILLED_ROUND) in recorded, recorded
        assert ("snapshot", KILLED_ROUND + 1) in recorded, recorded

        last_start = time.monotonic()
        await daemon.start()
        await daemon.wait_published(KILLED_ROUND)
        recovery_s = time.monotonic() - restarted
        last_recovery_s = time.monotonic() - last_start
        for round_ in range(KILLED_ROUND + 1, ROUNDS):
            await daemon.deliver(round_)
            await daemon.wait_published(round_)
        killed = await _outcome(daemon)
        entries = await daemon.audit()

    # Bit for bit what the uninterrupted coordinator published, round after round.
    for round_ in range(ROUNDS):
        stream, parameters_hash = killed.updates[round_]
        ref_stream, ref_hash = reference.updates[round_]
        assert stream == ref_stream, f"round {round_}: the update stream differs"
        assert parameters_hash == ref_hash, f"round {round_}: θ_{round_ + 1} differs"
    assert killed.final_hash == reference.final_hash
    assert (killed.checkpoint_hash, killed.checkpoint_round) == (killed.final_hash, ROUNDS)
    assert (reference.checkpoint_hash, reference.checkpoint_round) == (killed.final_hash, ROUNDS)

    # Applied once: one publication per round, each delta accepted once.
    published = [e.round for e in entries if e.action == "round.publish"]
    assert published == list(range(ROUNDS)), published
    accepted = sorted((e.round, e.region) for e in entries if e.action == "delta.accept")
    assert accepted == [(r, name) for r in range(ROUNDS) for name in REGIONS], accepted
    hashes = [e.details["params_hash"] for e in entries if e.action == "round.publish"]
    assert hashes == [reference.updates[r][1] for r in range(ROUNDS)]
    # The uninterrupted rounds summed their deltas as they were accepted; the restarted
    # coordinator decoded the killed round's deltas again, in the recorded arrival
    # order, and published the same bits as the reference, which had folded them.
    summation = {e.round: e.details["summation"] for e in entries if e.action == "round.publish"}
    assert summation == {
        r: "decoded at publication" if r == KILLED_ROUND else "folded on arrival"
        for r in range(ROUNDS)
    }, summation
    print(
        f"\ncoordinator killed at aggregate and at publish of round {KILLED_ROUND}: "
        f"θ_{KILLED_ROUND + 1} published {recovery_s:.1f} s after the first restart (two "
        f"process starts), {last_recovery_s:.1f} s after the last one; no delta was re-sent"
    )


def test_an_unknown_fault_point_is_a_configuration_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    setup = write_setup(tmp_path, _free_port())
    monkeypatch.setenv(FAULT_ENV, "aggregating")
    assert main(["coordinator", "--config", str(setup.config_path)]) == 2
    err = capsys.readouterr().err
    assert f"{FAULT_ENV}='aggregating': the phase must be one of aggregate, publish" in err
    monkeypatch.setenv(FAULT_ENV, "publish:last")
    assert main(["coordinator", "--config", str(setup.config_path)]) == 2
    assert "the round must be an integer >= 0" in capsys.readouterr().err
