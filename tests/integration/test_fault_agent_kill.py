"""A regional agent killed with SIGKILL in the middle of its upload, twice.

A real federation (Mosquitto with the production config, TLS and the generated ACL;
coordinator and two agents as processes, mutual TLS, SQLite), a quorum of one. The round
eu-west is first killed in, and stays down through, has a short deadline (round 0's
median arrival, at least 10 s): only the test waits for it to pass. Every other round's
is 60 s, long enough for a killed agent's restart and resume within its round (a round
both regions deliver closes at once, whatever its deadline). eu-west reaches the
coordinator through a userspace WAN proxy (``tests/support/wanproxy.py``) whose upstream
is capped at a few KB/s, so its delta takes seconds to go out; it is killed (the agent's
process group) once the coordinator has spooled some of the delta's frames but not all.
An observer records every status and round announcement on the broker. Nothing is
evaluated (``evaluation: none``): no assertion here looks at a loss.

* Offline: killed (no goodbye), eu-west's Last Will wins over the statuses it outlived,
  though the broker registered it when the agent connected (an older ``sent_at``): the
  coordinator shows the region offline (``GET /v1/regions``, and ``geofed_region_up`` 0,
  which ``GeofedRegionDown`` watches) within the agent's keep-alive. Restarted, the
  agent's new statuses replace the Will and the region is up again.
* Past the deadline: eu-west stays down until its round closes without it. Restarted,
  it drops its stale delta, syncs to the latest published parameters and delivers
  again; it lost only the rounds it was down for.
* Resume: killed again in the round after it rejoined and restarted at once, eu-west
  sends only the frames the coordinator did not hold (its report of the resumed upload
  names exactly those), and the round completes with both deltas.

Every round is published once, both regions trained each of their rounds from the
parameters the coordinator announced (the same hash), ending on the same θ, and the
coordinator's received bytes are the accepted deltas' and the lost delta's held frames:
each frame arrived once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.federation import FederationRun
from tests.support.observe import (
    WAIT_S,
    ControlObserver,
    audit_entries,
    check_same_parameters,
    observed_federation,
    poll,
    reap_orphans,
    sample,
    wait_job,
)
from tests.support.wanproxy import LinkSettings, WanProxy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REGIONS = ("eu-west", "us-east")
SLOW = "eu-west"
INNER_STEPS = 3
KILLED_ROUND = 1
#: Round 0, the killed round, at most one more lost, the rejoined one, the resumed one.
ROUNDS = 5
#: Upstream cap of the slow region's link in bytes per second: its ~32 KB delta takes ~4 s.
#: On from the start: a round's upload follows the previous publication too closely to
#: switch the cap on in between.
CAP_BPS = 8_000
#: The deadline of round 0 and of every round from 2 on: long enough for a capped upload,
#: and for a killed agent's restart and resume within its round on a loaded machine (a
#: restart starts three torch processes: the agent, its launcher and its rank).
DEADLINE_S = 60
#: The killed round's deadline at least (the median arrival of round 0 if longer): the
#: dead agent's round only has to close without it. Above the coordinator's upload_s.
KILLED_DEADLINE_S = 10
#: The job's adaptive deadline (coordinator/rounds/deadline.py) set to give exactly that:
#: round 0 has no samples (initial_s); round 1 has round 0's two, whose median (k = 0, no
#: slack) is clamped to at least min_s; from round 2 on the straggler of round 1 is in the
#: window (any share of stragglers grows it), so it grows 10-fold and is capped at max_s.
DEADLINE = {
    "initial_s": DEADLINE_S,
    "min_s": KILLED_DEADLINE_S,
    "max_s": DEADLINE_S,
    "min_samples": 2,
    "k": 0,
    "min_slack_ratio": 0,
    "straggler_fraction": 0,
    "growth": 10,
}
#: The coordinator's spool has settled once it went this long without a change.
SETTLE_S = 1.0
#: The slow agent's heartbeat_s, which is also its MQTT keep-alive.
HEARTBEAT_S = 2


def spooled_frames(fed: FederationRun, region: str, round_: int) -> set[int]:
    """Indices of the frames of ``region``'s round-``round_`` upload the coordinator holds
    (durable in its spool and recorded: the rows of its state store)."""
    uri = f"file:{fed.work / 'coordinator' / 'coordinator.db'}?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=5)) as db:
        rows = db.execute(
            "SELECT chunk_index FROM upload_chunks WHERE job_id = ? AND round = ? AND region = ?",
            (fed.job, round_, region),
        ).fetchall()
    return {int(index) for (index,) in rows}


def agent_spool(fed: FederationRun, region: str, round_: int) -> Path:
    return fed.work / "agents" / region / "jobs" / fed.job / "spool" / f"round-{round_}"


async def region_seen(fed: FederationRun) -> tuple[str, float, str]:
    """The slow region's state and detail in ``GET /v1/regions``, its ``geofed_region_up``."""
    body = await fed.get("/v1/regions")
    (entry,) = [e for e in body["regions"] if e["region"] == SLOW]
    up = sample(await fed.metrics_text(), "geofed_region_up", region=SLOW)
    return str(entry["state"]), up, str(entry.get("detail"))


async def seen_at(fed: FederationRun, offline: bool, what: str, timeout_s: float) -> float:
    """Poll the coordinator's view of the slow region until it is offline (and down) or
    not (and up); return when it was first seen so."""
    deadline = time.monotonic() + timeout_s
    seen: tuple[str, float, str] = ("", -1.0, "")
    while time.monotonic() < deadline:
        seen = await region_seen(fed)
        if ((seen[0] == "offline"), seen[1]) == (offline, 0.0 if offline else 1.0):
            return time.monotonic()
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what}: still {seen} after {timeout_s} s\n{fed.log_tails()}")


def configure(proxy: WanProxy) -> Callable[[str, dict[str, Any]], None]:
    """Route the slow region through ``proxy``; one worker per region (the fault is the
    agent's); the deadlines above, a quorum of one, no evaluation."""

    def customize(name: str, data: dict[str, Any]) -> None:
        if name == "coordinator":
            proxy.target_port = int(data["listen"]["port"])
            data["timeouts"] = {
                "connect_s": 5,
                "heartbeat_s": 2,
                "request_s": 5,
                "upload_s": KILLED_DEADLINE_S - 2,
                "download_s": KILLED_DEADLINE_S - 2,
                "round_deadline_s": 2 * DEADLINE_S,
            }
        elif name.startswith("agent-"):
            if name == f"agent-{SLOW}":
                data["coordinator_url"] = f"https://localhost:{proxy.port}"
                data["timeouts"]["heartbeat_s"] = HEARTBEAT_S
        elif name == "job":
            data["min_regions"] = 1
            data["deadline"] = DEADLINE
            data["evaluation"] = {"where": "none"}

    return customize


@dataclass(frozen=True)
class Kill:
    """What the coordinator held of the killed agent's delta once the link went quiet."""

    at: float
    sizes: list[int]
    held_frames: frozenset[int]

    @property
    def held(self) -> int:
        return len(self.held_frames)

    @property
    def held_bytes(self) -> int:
        return sum(self.sizes[i] for i in self.held_frames)

    @property
    def missing_bytes(self) -> int:
        return sum(self.sizes) - self.held_bytes


async def kill_mid_upload(
    fed: FederationRun, proxy: WanProxy, observer: ControlObserver, round_: int
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
    # With the connections closed nothing new can come; the spool has settled once 1 s
    # passes without a change (a received frame is written within milliseconds). Looked
    # at every 0.1 s: a change restarts the second from when it was seen.
    held = spooled_frames(fed, SLOW, round_)
    changed_at = time.monotonic()
    while time.monotonic() - changed_at < SETTLE_S:
        await asyncio.sleep(0.1)
        if (now := spooled_frames(fed, SLOW, round_)) != held:
            held, changed_at = now, time.monotonic()
    # Several frames travel at once (transfer.upload_window), so the held ones need not
    # be the first ones; the kill came before the last one.
    assert 0 < len(held) < len(sizes), (held, len(sizes))
    return Kill(killed_at, sizes, frozenset(held))


@contextlib.asynccontextmanager
async def slow_federation(
    tmp_path: Path, *, rounds: int, seed: int
) -> AsyncIterator[tuple[FederationRun, WanProxy, ControlObserver]]:
    """Both regions training under an observer, the slow one through a capped proxy."""
    proxy = WanProxy(
        "127.0.0.1", 0, "127.0.0.1", 0, seed=seed, upstream=LinkSettings(bandwidth_bps=CAP_BPS)
    )
    async with (
        proxy,
        observed_federation(
            tmp_path,
            regions=REGIONS,
            rounds=rounds,
            inner_steps=INNER_STEPS,
            broker="mosquitto",
            customize=configure(proxy),
        ) as (fed, observer),
    ):
        try:
            yield fed, proxy, observer
        finally:
            reap_orphans(fed, SLOW)


async def test_an_agent_killed_mid_upload_rejoins_or_resumes_and_loses_only_its_rounds(
    tmp_path: Path,
) -> None:
    async with slow_federation(tmp_path, rounds=ROUNDS, seed=2) as (fed, proxy, observer):
        # Down past the deadline: the round closes with the quorum of one, without it.
        await fed.wait_round(KILLED_ROUND)
        # Its statuses since round 0 are newer than its Will. The coordinator's view is
        # watched from before the kill, so the time to offline counts from the kill.
        state, up, _ = await region_seen(fed)
        assert state != "offline", state
        assert up == 1.0
        offline = asyncio.create_task(seen_at(fed, True, f"{SLOW} seen offline", WAIT_S))
        try:
            lost = await kill_mid_upload(fed, proxy, observer, KILLED_ROUND)
            down_s = await offline - lost.at
        finally:
            offline.cancel()
        state, _, detail = await region_seen(fed)
        assert (state, detail) == ("offline", "connection lost")
        assert sample(await fed.metrics_text(), "geofed_regions_up") == 1  # us-east's
        await wait_job(
            fed,
            lambda job: int(job["round"]) > KILLED_ROUND,
            f"round {KILLED_ROUND} to close without {SLOW}",
            killed=f"agent-{SLOW}",
        )
        restarted_at = time.monotonic()
        await fed.restart(f"agent-{SLOW}")  # its link still capped
        up_s = await seen_at(fed, False, f"the restarted {SLOW} seen up", 120) - restarted_at
        rounds_after = range(KILLED_ROUND + 1, ROUNDS - 1)
        await poll(
            fed,
            lambda: any(observer.accepted(SLOW, r) for r in rounds_after),
            f"{SLOW} to deliver a round after its restart",
        )
        rejoined = next(r for r in rounds_after if observer.accepted(SLOW, r))
        back_at = observer.accepted(SLOW, rejoined)[-1][0]

        # Killed again mid-upload and restarted at once: it resumes its spooled delta.
        resumed_round = rejoined + 1
        await fed.wait_round(resumed_round)
        kill = await kill_mid_upload(fed, proxy, observer, resumed_round)
        job = await fed.status()
        assert job["round"] == resumed_round, job
        assert job["current"]["delivered"] == ["us-east"], job
        proxy.upstream = LinkSettings()
        upstream_before = proxy.stats().bytes_upstream
        await fed.restart(f"agent-{SLOW}")
        await poll(fed, lambda: bool(observer.accepted(SLOW, resumed_round)), "the resume")
        accepted_at, report = observer.accepted(SLOW, resumed_round)[-1]
        upstream_resumed = proxy.stats().bytes_upstream - upstream_before

        final = await fed.wait_for(
            lambda job: job.get("state") == "completed",
            timeout_s=WAIT_S + (ROUNDS - resumed_round) * DEADLINE_S,
            what="the job to complete",
        )
        entries = await audit_entries(fed, job=fed.job, verify=True)
        metrics = await fed.metrics_text()
        await check_same_parameters(
            fed,
            observer,
            ROUNDS,
            {"us-east": set(range(ROUNDS)), SLOW: {0, *range(rejoined, ROUNDS)}},
        )

    # The broker publishes the Will as soon as it sees the connection close, at the latest
    # 1.5 keep-alives after the last packet.
    assert down_s < 1.5 * HEARTBEAT_S + 1.0, down_s
    assert final["round"] == ROUNDS
    publishes = [e for e in entries if e.action == "round.publish"]
    assert [e.round for e in publishes] == list(range(ROUNDS))
    # Rounds lost: the one it was killed in, and at most the next (opened while it restarted).
    assert rejoined in (KILLED_ROUND + 1, KILLED_ROUND + 2), rejoined
    for round_, e in enumerate(publishes):
        absent = KILLED_ROUND <= round_ < rejoined
        assert e.details["included"] == (["us-east"] if absent else sorted(REGIONS)), e.details
        assert e.details["stragglers"] == ([SLOW] if absent else []), e.details
    accepts = [e for e in entries if e.action == "delta.accept"]
    assert sorted((e.round, e.region) for e in accepts) == sorted(
        [(r, "us-east") for r in range(ROUNDS)] + [(r, SLOW) for r in (0, *range(rejoined, ROUNDS))]
    )
    # The restarted agent dropped the stale delta instead of resuming it.
    assert not agent_spool(fed, SLOW, KILLED_ROUND).exists()
    log = (tmp_path / "logs" / f"agent-{SLOW}.log").read_text()
    assert f"round {KILLED_ROUND}: the spooled delta was not taken" in log

    # The resumed delta: the agent sent exactly the frames the coordinator did not hold.
    match = re.match(r"delta accepted \((\d+) chunks, (\d+) bytes sent", report.detail)
    assert match, report.detail
    frames, missing_bytes = len(kill.sizes) - kill.held, kill.missing_bytes
    assert (int(match[1]), int(match[2])) == (frames, missing_bytes), report.detail
    assert f"round {resumed_round}: resuming the spooled delta" in log
    resumed = next(e for e in accepts if (e.round, e.region) == (resumed_round, SLOW))
    assert int(resumed.details["size"]) == sum(kill.sizes)

    # Each frame reached the coordinator once: it counted the accepted deltas' bytes and
    # the frames of the delta lost past the deadline, never counted as accepted.
    accepted_bytes = sum(int(e.details["size"]) for e in accepts)
    received = sample(metrics, "geofed_received_bytes_total", kind="model_delta")
    assert received == accepted_bytes + lost.held_bytes

    print(
        f"\nkill -9 to offline at the coordinator {down_s:.2f} s; restart to up {up_s:.1f} s"
        f"\npast the deadline: killed in round {KILLED_ROUND} with {lost.held} of "
        f"{len(lost.sizes)} frames held; rejoined in round {rejoined} "
        f"({rejoined - KILLED_ROUND} round(s) lost); restart to accepted delta "
        f"{back_at - restarted_at:.1f} s, kill to accepted delta {back_at - lost.at:.1f} s"
        f"\nresume: delta of {sum(kill.sizes)} bytes in {len(kill.sizes)} frames; the "
        f"coordinator held {kill.held} frames ({kill.held_bytes} bytes) at the "
        f"kill; after the restart the agent sent {frames} frames ({missing_bytes} bytes), "
        f"0 acknowledged bytes again; {upstream_resumed} bytes upstream on the wire (TLS, "
        f"HTTP and the manifest included); kill to accepted delta "
        f"{accepted_at - kill.at:.1f} s"
    )
