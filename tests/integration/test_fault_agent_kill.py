"""A regional agent killed with SIGKILL in the middle of its upload.

A real federation (embedded broker, coordinator and two agents as processes, mutual TLS,
SQLite). eu-west reaches the coordinator through a userspace WAN proxy
(``tests/support/wanproxy.py``) whose upstream is capped at a few KB/s, so its delta takes
seconds to go out; it is killed (the agent's process group) once the coordinator has
spooled some of the delta's frames but not all. An observer records every status and
round announcement on the broker.

* Resume: restarted at once, eu-west sends only the frames the coordinator did not hold
  (its report of the resumed upload names exactly those), the coordinator's received
  bytes equal the accepted deltas' sizes (each frame arrived once), and the round
  completes with both deltas.
* Past the deadline: with a short deadline and a quorum of one, eu-west stays down until
  its round closes without it. Restarted, it drops its stale delta, syncs to the latest
  published parameters and delivers again; it lost only the rounds it was down for.

Both: every round is published once, and both regions trained each of their rounds from
the parameters the coordinator announced (the same hash), ending on the same θ. The
helpers here (observer, polling, audit, agent ``/metrics``) serve the other fault tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.audit import AuditEntry
from geofed.control import Backoff, ControlClient, Topics
from geofed.control.messages import RegionStatus, RoundAnnouncement, decode_any
from geofed.pki import client_ssl_context, load_trust_bundle
from geofed.pki.httpauth import VerifiedConnector
from geofed.types import Identity, Role
from regional_agent.launcher import descendants
from tests.support.federation import FEDERATION, FederationRun, running_federation
from tests.support.wanproxy import LinkSettings, WanProxy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REGIONS = ("eu-west", "us-east")
SLOW = "eu-west"
INNER_STEPS = 3
KILLED_ROUND = 1
#: Upstream cap of the slow region's link in bytes per second: its ~32 KB delta takes ~8 s.
#: On from the start: a round's upload follows the previous publication too closely to
#: switch the cap on in between.
CAP_BPS = 4_000
#: The round deadline of the past-the-deadline case (the coordinator's upload_s is below).
DEADLINE_S = 30
WAIT_S = 120.0


@dataclass
class Observer:
    """Every status and announcement on the federation's topics, with its arrival time."""

    port: int
    backoff: Backoff | None = None
    statuses: list[tuple[float, RegionStatus]] = field(default_factory=list)
    announcements: list[RoundAnnouncement] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.client = ControlClient(
            "127.0.0.1", self.port, client_id="observer.tests", backoff=self.backoff
        )
        self._task: asyncio.Task[None] | None = None

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

    def accepted(self, region: str, round_: int) -> list[tuple[float, RegionStatus]]:
        """The statuses in which ``region`` reported its delta of ``round_`` accepted."""
        return [
            (at, s)
            for at, s in self.statuses
            if s.region == region and s.round == round_ and s.detail.startswith("delta accepted")
        ]


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


def check_others_alive(fed: FederationRun, killed: str | None) -> None:
    for child in fed.children.children:
        if child.name != killed:
            child.check_alive()


async def wait_job(
    fed: FederationRun,
    predicate: Callable[[dict[str, Any]], bool],
    what: str,
    *,
    killed: str | None = None,
    timeout_s: float = WAIT_S,
) -> dict[str, Any]:
    """Poll the job's status until ``predicate`` holds (``killed`` may be down meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while True:
        check_others_alive(fed, killed)
        job = await fed.status()
        if predicate(job):
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}: {job}")
        await asyncio.sleep(0.5)


async def start_agents(fed: FederationRun, observer: Observer) -> None:
    """Start every agent, wait for their worker groups, and submit the job."""
    for region in REGIONS:
        await fed.start_agent(region)

    def ready() -> bool:
        return all(
            any(s.region == r and s.detail == "ready" for _, s in observer.statuses)
            for r in REGIONS
        )

    await poll(fed, ready, "the agents' worker groups to start")
    status, body = await fed.submit()
    assert status == 201, body


def sample(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def agent_metrics(fed: FederationRun, region: str) -> str:
    """Scrape the agent's ``/metrics`` as an observer (its URL is in its start-up log)."""
    log = fed.work / "logs" / f"agent-{region}.log"
    url = next(
        line.rsplit(" ", 1)[-1]
        for line in log.read_text().splitlines()
        if "serving metrics on https://" in line
    )
    bundle = load_trust_bundle(fed.federation.trust_bundle)
    context = client_ssl_context(bundle, fed.observer.cert, fed.observer.key)
    context.check_hostname = False  # the demo's region certificates name no host
    expect = Identity(federation=FEDERATION, role=Role.REGION, name=region)
    connector = VerifiedConnector(bundle, context, expect=expect)
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.get(url) as response,
    ):
        assert response.status == 200, await response.text()
        return await response.text()


async def audit_entries(fed: FederationRun) -> list[AuditEntry]:
    page = await fed.get(f"/v1/audit?job={fed.job}&limit=1000&verify=1")
    assert page["verify"]["ok"], page["verify"]
    return [AuditEntry.from_dict(e) for e in page["entries"]]


def spooled_frames(fed: FederationRun, region: str, round_: int) -> set[int]:
    """Indices of the frames of ``region``'s round-``round_`` upload the coordinator holds."""
    root = fed.work / "coordinator" / "spool" / fed.job / str(round_) / region
    return {int(p.name.removeprefix("chunk-")) for p in root.glob("*/chunk-*")}


def agent_spool(fed: FederationRun, region: str, round_: int) -> Path:
    return fed.work / "agents" / region / "jobs" / fed.job / "spool" / f"round-{round_}"


def held_params(fed: FederationRun, region: str) -> dict[str, Any]:
    """Which θ the region holds on disk."""
    path = fed.work / "agents" / region / "jobs" / fed.job / "params" / "current.json"
    data = json.loads(path.read_text())
    return {"round": data["round"], "hash": data["hash"]}


def configure(
    proxy: WanProxy, *, deadline_s: int | None = None
) -> Callable[[str, dict[str, Any]], None]:
    """Route the slow region through ``proxy``; one worker per region (the fault is the
    agent's); with ``deadline_s``, a fixed short deadline and a quorum of one."""

    def customize(name: str, data: dict[str, Any]) -> None:
        if name == "coordinator":
            proxy.target_port = int(data["listen"]["port"])
            if deadline_s is not None:
                data["timeouts"] = {
                    "connect_s": 5,
                    "heartbeat_s": 2,
                    "request_s": 5,
                    "upload_s": deadline_s // 2,
                    "download_s": deadline_s // 2,
                    "round_deadline_s": 2 * deadline_s,
                }
        elif name.startswith("agent-"):
            data["workers"]["count"] = 1
            if name == f"agent-{SLOW}":
                data["coordinator_url"] = f"https://localhost:{proxy.port}"
        elif name == "job" and deadline_s is not None:
            data["min_regions"] = 1
            data["deadline"] = {"initial_s": deadline_s, "min_s": deadline_s, "max_s": deadline_s}

    return customize


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
    if "torch.distributed.run" in cmdline and str(root) in cmdline:
        for victim in descendants([pid]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)


@dataclass(frozen=True)
class Kill:
    """What the coordinator held of the killed agent's delta once the link went quiet."""

    at: float
    sizes: list[int]
    held: int


async def kill_mid_upload(
    fed: FederationRun, proxy: WanProxy, observer: Observer, round_: int
) -> Kill:
    """SIGKILL the slow region's agent while the coordinator holds some of its frames."""
    manifest = agent_spool(fed, SLOW, round_) / "manifest.json"
    await poll(fed, manifest.exists, f"{SLOW} to spool its delta of round {round_}")
    sizes = [int(c["size"]) for c in json.loads(manifest.read_text())["manifest"]["chunks"]]
    assert len(sizes) >= 8, sizes
    await poll(
        fed, lambda: len(spooled_frames(fed, SLOW, round_)) >= 3, "the first frames to arrive"
    )
    assert not observer.accepted(SLOW, round_)
    killed_at = time.monotonic()
    await fed.kill(f"agent-{SLOW}")

    # A frame already in the dead agent's socket buffer may still arrive whole: wait
    # until the link is idle and the coordinator's spool settles before counting.
    await poll(
        fed,
        lambda: proxy.stats().connections_open == 0,
        "the dead agent's connections to close",
        killed=f"agent-{SLOW}",
    )
    held: set[int] | None = None
    while (now := spooled_frames(fed, SLOW, round_)) != held:
        held = now
        await asyncio.sleep(2.0)
    # Frames go out in order; the kill came before the last one.
    assert held == set(range(len(held))), held
    assert 0 < len(held) < len(sizes), (held, len(sizes))
    return Kill(killed_at, sizes, len(held))


def check_same_parameters(
    fed: FederationRun, observer: Observer, rounds: int, trained: dict[str, set[int]]
) -> None:
    """Each region trained exactly ``trained[region]``, each from the θ_r announced for it,
    and both hold the same last θ."""
    announced = {a.round: a.base_hash for a in observer.announcements if a.state == "open"}
    assert set(announced) == set(range(rounds)), sorted(announced)
    reported: dict[tuple[int, str], set[str]] = defaultdict(set)
    for _, s in observer.statuses:
        if s.job == fed.job and s.round is not None and s.params_hash is not None:
            reported[(s.round, s.region)].add(s.params_hash)
    for (round_, region), hashes in reported.items():
        assert hashes == {announced[round_]}, (round_, region, hashes)
    for region in REGIONS:
        delivered = {r for r in range(rounds) if observer.accepted(region, r)}
        assert delivered == trained[region], (region, delivered)
        last = rounds - 1
        assert held_params(fed, region) == {"round": last, "hash": announced[last]}, region


async def test_agent_killed_mid_upload_resumes_without_resending_acknowledged_frames(
    tmp_path: Path,
) -> None:
    rounds = 3
    proxy = WanProxy(
        "127.0.0.1", 0, "127.0.0.1", 0, seed=1, upstream=LinkSettings(bandwidth_bps=CAP_BPS)
    )
    async with (
        proxy,
        running_federation(
            tmp_path,
            regions=REGIONS,
            rounds=rounds,
            inner_steps=INNER_STEPS,
            customize=configure(proxy),
            start_agents=False,
        ) as fed,
    ):
        observer = Observer(fed.mqtt_port)
        await observer.start()
        try:
            await start_agents(fed, observer)
            await fed.wait_round(KILLED_ROUND)
            kill = await kill_mid_upload(fed, proxy, observer, KILLED_ROUND)
            job = await fed.status()
            assert job["round"] == KILLED_ROUND, job
            assert job["current"]["delivered"] == ["us-east"], job

            proxy.upstream = LinkSettings()
            upstream_before = proxy.stats().bytes_upstream
            await fed.restart(f"agent-{SLOW}")
            await poll(fed, lambda: bool(observer.accepted(SLOW, KILLED_ROUND)), "the resume")
            accepted_at, report = observer.accepted(SLOW, KILLED_ROUND)[-1]
            upstream_resumed = proxy.stats().bytes_upstream - upstream_before

            final = await fed.wait_completed(timeout_s=WAIT_S)
            entries = await audit_entries(fed)
            metrics = await fed.metrics_text()
            check_same_parameters(
                fed, observer, rounds, {region: set(range(rounds)) for region in REGIONS}
            )
        finally:
            reap_orphans(fed, SLOW)
            await observer.stop()

    # The restarted agent sent exactly the frames the coordinator did not hold.
    match = re.match(r"delta accepted \((\d+) chunks, (\d+) bytes sent", report.detail)
    assert match, report.detail
    frames, missing_bytes = len(kill.sizes) - kill.held, sum(kill.sizes[kill.held :])
    assert (int(match[1]), int(match[2])) == (frames, missing_bytes), report.detail
    log = (tmp_path / "logs" / f"agent-{SLOW}.log").read_text()
    assert f"round {KILLED_ROUND}: resuming the spooled delta" in log

    # Each frame reached the coordinator once: it counted exactly the accepted deltas' bytes.
    assert final["round"] == rounds
    accepts = [e for e in entries if e.action == "delta.accept"]
    assert sorted((e.round, e.region) for e in accepts) == [
        (r, g) for r in range(rounds) for g in sorted(REGIONS)
    ]
    assert [e.round for e in entries if e.action == "round.publish"] == list(range(rounds))
    accepted_bytes = sum(int(e.details["size"]) for e in accepts)
    assert sample(metrics, "geofed_received_bytes_total", kind="model_delta") == accepted_bytes
    resumed = next(e for e in accepts if (e.round, e.region) == (KILLED_ROUND, SLOW))
    assert int(resumed.details["size"]) == sum(kill.sizes)

    print(
        f"\nresume: delta of {sum(kill.sizes)} bytes in {len(kill.sizes)} frames; the "
        f"coordinator held {kill.held} frames ({sum(kill.sizes[: kill.held])} bytes) at the "
        f"kill; after the restart the agent sent {frames} frames ({missing_bytes} bytes), "
        f"0 acknowledged bytes again; {upstream_resumed} bytes upstream on the wire (TLS, "
        f"HTTP and the manifest included); kill to accepted delta "
        f"{accepted_at - kill.at:.1f} s"
    )


async def test_agent_down_past_the_deadline_rejoins_from_the_latest_parameters(
    tmp_path: Path,
) -> None:
    rounds = 4
    proxy = WanProxy(
        "127.0.0.1", 0, "127.0.0.1", 0, seed=2, upstream=LinkSettings(bandwidth_bps=CAP_BPS)
    )
    async with (
        proxy,
        running_federation(
            tmp_path,
            regions=REGIONS,
            rounds=rounds,
            inner_steps=INNER_STEPS,
            customize=configure(proxy, deadline_s=DEADLINE_S),
            start_agents=False,
        ) as fed,
    ):
        observer = Observer(fed.mqtt_port)
        await observer.start()
        try:
            await start_agents(fed, observer)
            await fed.wait_round(KILLED_ROUND)
            kill = await kill_mid_upload(fed, proxy, observer, KILLED_ROUND)

            # Down past the deadline: the round closes with the quorum of one, without it.
            await wait_job(
                fed,
                lambda job: int(job["round"]) > KILLED_ROUND,
                f"round {KILLED_ROUND} to close without {SLOW}",
                killed=f"agent-{SLOW}",
            )
            proxy.upstream = LinkSettings()
            restarted_at = time.monotonic()
            await fed.restart(f"agent-{SLOW}")
            final = await fed.wait_completed(timeout_s=WAIT_S + rounds * DEADLINE_S)
            entries = await audit_entries(fed)
            metrics = await fed.metrics_text()
            again = [r for r in range(KILLED_ROUND + 1, rounds) if observer.accepted(SLOW, r)]
            assert again, f"{SLOW} delivered no round after its restart"
            rejoined = again[0]
            back_at = observer.accepted(SLOW, rejoined)[-1][0]
            check_same_parameters(
                fed,
                observer,
                rounds,
                {"us-east": set(range(rounds)), SLOW: {0, *range(rejoined, rounds)}},
            )
        finally:
            reap_orphans(fed, SLOW)
            await observer.stop()

    assert final["round"] == rounds
    publishes = [e for e in entries if e.action == "round.publish"]
    assert [e.round for e in publishes] == list(range(rounds))
    # Rounds lost: the one it was killed in, and at most the next (opened while it restarted).
    assert rejoined in (KILLED_ROUND + 1, KILLED_ROUND + 2), rejoined
    for round_, e in enumerate(publishes):
        absent = KILLED_ROUND <= round_ < rejoined
        assert e.details["included"] == (["us-east"] if absent else sorted(REGIONS)), e.details
        assert e.details["stragglers"] == ([SLOW] if absent else []), e.details
    accepts = [e for e in entries if e.action == "delta.accept"]
    assert sorted((e.round, e.region) for e in accepts) == sorted(
        [(r, "us-east") for r in range(rounds)] + [(r, SLOW) for r in (0, *range(rejoined, rounds))]
    )
    # The frames of the lost delta were received once and never counted as accepted.
    accepted_bytes = sum(int(e.details["size"]) for e in accepts)
    received = sample(metrics, "geofed_received_bytes_total", kind="model_delta")
    assert received == accepted_bytes + sum(kill.sizes[: kill.held])
    # The restarted agent dropped the stale delta instead of resuming it.
    assert not agent_spool(fed, SLOW, KILLED_ROUND).exists()
    log = (tmp_path / "logs" / f"agent-{SLOW}.log").read_text()
    assert f"round {KILLED_ROUND}: the spooled delta was not taken" in log

    print(
        f"\npast the deadline: killed in round {KILLED_ROUND} with {kill.held} of "
        f"{len(kill.sizes)} frames held; rejoined in round {rejoined} "
        f"({rejoined - KILLED_ROUND} round(s) lost); restart to accepted delta "
        f"{back_at - restarted_at:.1f} s, kill to accepted delta {back_at - kill.at:.1f} s"
    )
