"""Watching a running federation from outside, as the integration and fault tests do.

Prometheus samples, the coordinator's audit log page by page, an agent's ``/metrics``,
an MQTT observer recording every region status and round announcement, polling with the
federation's processes checked on the way, what a region holds on disk, and reaping the
worker group a killed agent left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import ssl
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from coordinator.state.audit import AuditEntry
from geofed.backoff import Backoff
from geofed.control import ControlClient, Topics
from geofed.control.messages import RegionStatus, RoundAnnouncement, decode_any
from geofed.pki import client_ssl_context, load_trust_bundle
from geofed.pki.httpauth import VerifiedConnector
from geofed.types import Identity, Role
from regional_agent.launch.launcher import descendants
from regional_agent.launch.spec import is_launcher_command
from tests.support.federation import (
    FEDERATION,
    STATUS_POLL_S,
    FederationRun,
    running_federation,
)
from tests.support.waiting import eventually

#: How long a fault test waits for one step of its scenario.
WAIT_S = 120.0


def sample(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def audit_entries(
    fed: FederationRun, *, job: str | None = None, verify: bool = False
) -> list[AuditEntry]:
    """Every audit entry (of ``job`` only, if given), page by page; with ``verify``, the
    coordinator must also find its whole stored chain intact."""
    query = f"&job={job}" if job is not None else ""
    entries: list[AuditEntry] = []
    after = 0
    while True:
        check = "&verify=1" if verify and after == 0 else ""
        page = await fed.get(f"/v1/audit?after={after}&limit=1000{query}{check}")
        if check:
            assert page["verify"]["ok"], page["verify"]
        batch = [AuditEntry.from_dict(e) for e in page["entries"]]
        if not batch:
            return entries
        entries.extend(batch)
        after = batch[-1].seq


async def agent_metrics(fed: FederationRun, region: str) -> str:
    """The agent's ``/metrics``, read with the observer's certificate (the URL is in its log)."""
    log = fed.work / "logs" / f"agent-{region}.log"
    match = re.search(r"serving metrics on (https://\S+/metrics)", log.read_text(errors="replace"))
    assert match, f"agent {region} logged no metrics URL"
    bundle = load_trust_bundle(fed.federation.trust_bundle)
    context = client_ssl_context(bundle, fed.observer.cert, fed.observer.key)
    context.check_hostname = False  # the demo's region certificates name no host
    identity = Identity(federation=FEDERATION, role=Role.REGION, name=region)
    connector = VerifiedConnector(bundle, context, expect=identity)
    async with (
        aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as s,
        s.get(match[1]) as response,
    ):
        assert response.status == 200, await response.text()
        return await response.text()


@dataclass
class ControlObserver:
    """Every status (with its arrival time) and round announcement on the federation's
    topics. ``tls`` is for Mosquitto with mutual TLS (see :meth:`with_certificate`)."""

    port: int
    tls: ssl.SSLContext | None = None
    backoff: Backoff | None = None
    statuses: list[tuple[float, RegionStatus]] = field(default_factory=list)
    announcements: list[RoundAnnouncement] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.client = ControlClient(
            "127.0.0.1", self.port, client_id="observer.tests", tls=self.tls, backoff=self.backoff
        )
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def with_certificate(
        cls, fed: FederationRun, backoff: Backoff | None = None
    ) -> ControlObserver:
        """An observer principal with the federation's observer certificate."""
        bundle = load_trust_bundle(fed.federation.trust_bundle)
        tls = client_ssl_context(bundle, fed.observer.cert, fed.observer.key)
        return cls(fed.mqtt_port, tls=tls, backoff=backoff)

    async def _on_message(self, topic: str, payload: bytes) -> None:
        message = decode_any(payload)
        if isinstance(message, RegionStatus):
            self.statuses.append((time.monotonic(), message))
        elif isinstance(message, RoundAnnouncement):
            self.announcements.append(message)

    async def start(self) -> None:
        await self.client.subscribe(Topics(FEDERATION).everything(), self._on_message)
        self._task = asyncio.create_task(self.client.run())
        await self.client.wait_connected(30)

    async def stop(self) -> None:
        await self.client.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[ControlObserver]:
        try:
            await self.start()
            yield self
        finally:
            await self.stop()

    def accepted(
        self, region: str, round_: int, job: str | None = None
    ) -> list[tuple[float, RegionStatus]]:
        """The statuses in which ``region`` reported its delta of ``round_`` (of ``job``,
        if given) accepted."""
        return [
            (at, s)
            for at, s in self.statuses
            if s.region == region
            and s.round == round_
            and s.detail.startswith("delta accepted")
            and job in (None, s.job)
        ]


def check_others_alive(fed: FederationRun, killed: str | None) -> None:
    """Fail if a child process other than ``killed`` has exited."""
    for child in fed.children.children:
        if child.name != killed:
            child.check_alive()


async def poll(
    fed: FederationRun,
    predicate: Callable[[], bool],
    what: str,
    *,
    killed: str | None = None,
    timeout_s: float = WAIT_S,
) -> None:
    """Wait for ``predicate``; fail if a child other than ``killed`` has exited."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        check_others_alive(fed, killed)
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


async def wait_job(
    fed: FederationRun,
    predicate: Callable[[dict[str, Any]], bool],
    what: str,
    *,
    killed: str | None = None,
    timeout_s: float = WAIT_S,
    job: str | None = None,
) -> dict[str, Any]:
    """Poll ``job``'s status (the federation's own by default) until ``predicate`` holds
    (``killed`` may be down meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while True:
        check_others_alive(fed, killed)
        status = await fed.status(job)
        if predicate(status):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}: {status}")
        await asyncio.sleep(STATUS_POLL_S)


async def start_agents(
    fed: FederationRun, observer: ControlObserver, *, submit: bool = True
) -> None:
    """Start every agent, wait for the coordinator and their worker groups, and (unless
    told not to) submit the job."""
    for region in fed.regions:
        await fed.start_agent(region)
    await fed.wait_ready()

    def ready() -> bool:
        return all(
            any(s.region == r and s.detail == "ready" for _, s in observer.statuses)
            for r in fed.regions
        )

    await poll(fed, ready, "the agents' worker groups to start")
    if submit:
        status, body = await fed.submit()
        assert status == 201, body


@contextlib.asynccontextmanager
async def observed_federation(
    tmp_path: Path, *, backoff: Backoff | None = None, submit: bool = True, **options: Any
) -> AsyncIterator[tuple[FederationRun, ControlObserver]]:
    """A federation (``options`` as for ``running_federation``, the embedded broker by
    default) whose agents start, and whose job is submitted (unless ``submit`` is false),
    under a running observer (with the observer's certificate on Mosquitto)."""
    async with running_federation(tmp_path, start_agents=False, ready=False, **options) as fed:
        if options.get("broker") == "mosquitto":
            observer = ControlObserver.with_certificate(fed, backoff)
        else:
            observer = ControlObserver(fed.mqtt_port, backoff=backoff)
        async with observer.running():
            await start_agents(fed, observer, submit=submit)
            yield fed, observer


async def stop_agents(fed: FederationRun) -> None:
    """Stop every agent cleanly and at once, before the federation's end."""
    await asyncio.gather(*(fed.kill(f"agent-{r}", signal.SIGTERM) for r in fed.regions))
    fed.children.children = [c for c in fed.children.children if c.returncode is None]


def reap_orphans(fed: FederationRun, region: str) -> None:
    """Kill the worker group a killed agent left behind, unless an agent runs again.

    Its launcher leads a session of its own, so it outlives the agent's process group; a
    restarted agent reaps it, and this does it for a test that fails before then.
    """
    if any(c.name == f"agent-{region}" and c.returncode is None for c in fed.children.children):
        return
    root = fed.work / "agents" / region / "workers"
    try:
        pid = int((root / "launcher.pid").read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, ValueError, IndexError):
        return
    if is_launcher_command(cmdline) and str(root) in cmdline:
        for victim in descendants([pid]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)


def worker_ranks(fed: FederationRun, region: str) -> list[int]:
    """The processes of a region's worker group under its launcher (its ranks)."""
    root = fed.work / "agents" / region / "workers"
    launcher = int((root / "launcher.pid").read_text().split()[0])
    ranks = sorted(descendants([launcher]) - {launcher})
    assert ranks, f"{region}'s launcher {launcher} has no worker process"
    return ranks


def signal_all(pids: Sequence[int], sig: signal.Signals) -> None:
    """Send ``sig`` to each of ``pids`` (SIGSTOP freezes a worker group, SIGCONT thaws it);
    one that has exited meanwhile is passed over."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def held_params(fed: FederationRun, region: str, job: str | None = None) -> dict[str, Any]:
    """Which θ of ``job`` (the federation's own by default) the region holds on disk."""
    path = fed.work / "agents" / region / "jobs" / (job or fed.job) / "params" / "current.json"
    data = json.loads(path.read_text())
    return {"round": data["round"], "hash": data["hash"]}


async def check_same_parameters(
    fed: FederationRun,
    observer: ControlObserver,
    rounds: int,
    trained: dict[str, set[int]],
    *,
    job: str | None = None,
    settle_s: float = 10.0,
) -> None:
    """Each region trained exactly ``trained[region]`` of ``job`` (the federation's own by
    default), each from the θ_r announced for it, and every region that trained the last
    round holds its θ (one that missed it, an announced θ from the last it trained on).

    A region reports its delta accepted over MQTT once its upload was answered, so the
    job may complete before the observer hears the last report: the expected reports
    are waited for (``settle_s`` at most) before anything is judged.
    """

    job = job or fed.job

    def all_reported() -> bool:
        return all(
            observer.accepted(region, r, job) for region in fed.regions for r in trained[region]
        )

    with contextlib.suppress(TimeoutError):
        await eventually(all_reported, timeout_s=settle_s)
    announced = {
        a.round: a.base_hash for a in observer.announcements if a.job == job and a.state == "open"
    }
    assert set(announced) == set(range(rounds)), sorted(announced)
    reported: dict[tuple[int, str], set[str]] = defaultdict(set)
    for _, s in observer.statuses:
        if s.job == job and s.round is not None and s.params_hash is not None:
            reported[(s.round, s.region)].add(s.params_hash)
    for (round_, region), hashes in reported.items():
        assert hashes == {announced[round_]}, (round_, region, hashes)
    last = rounds - 1
    for region in fed.regions:
        delivered = {r for r in range(rounds) if observer.accepted(region, r, job)}
        assert delivered == trained[region], (region, delivered)
        held = held_params(fed, region, job)
        # A region that missed the last round may have seen the job end before it reached
        # θ_last (its download cut short by the end): it holds the θ of a round between
        # the last it trained and the last, as announced.
        first = last if last in trained[region] else max(trained[region], default=0)
        assert first <= held["round"] <= last, (region, held, sorted(trained[region]))
        assert held["hash"] == announced[held["round"]], (region, held, announced)
