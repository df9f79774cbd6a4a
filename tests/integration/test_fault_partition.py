"""One region partitioned from the coordinator for longer than a round's deadline.

A coordinator and two regional agents (eu-west and ap-south) as real processes,
Mosquitto with mutual TLS, and ap-south's data plane (HTTPS to the coordinator) routed
through a userspace WAN proxy (tests/support/wanproxy.py) with 100 ms of latency each
way, so that its round 1 takes seconds. Once ap-south's delta of round 0 is accepted, its
link is partitioned: everything it sends is held, nothing comes back. The job needs a
quorum of 1 of 2 and adapts its deadline from 2 samples on (slack: one spread, not
three), growing it when more than 30% of the samples are stragglers; the coordinator
quarantines a region after 2 bad rounds in a row, for a cool-down of 8 rounds. The link
heals, without latency, once ap-south is quarantined. Nothing is evaluated
(``evaluation: none``): no assertion here looks at a loss.

What it proves (the issue's scenarios 5 and 7):

- the round deadline adapts: round 0 uses the initial deadline, round 1 the median of
  observed arrival times plus slack (far shorter), round 3 grows after two rounds with a
  straggler, and every announced deadline stays within the job's bounds;
- rounds 1 and 2 close at their deadlines with quorum, ap-south counted a straggler
  (``geofed_stragglers_total``, the ``round.publish`` audit entries);
- after two misses ap-south is quarantined: left out of rounds 3 to 10, and shown in
  ``GET /v1/regions``, ``geofed_region_quarantined``, the job status and
  ``geofed job status``;
- the partition heals once it is quarantined; after the cool-down ap-south is let back
  in (round 11), catches up from the checkpoint chain, delivers it, and every region
  ends the job from the same parameters.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from geofed_cli import main
from tests.support.federation import FederationRun, running_federation
from tests.support.observe import ControlObserver, audit_entries, sample, stop_agents
from tests.support.wanproxy import LinkSettings, WanProxy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

COOLDOWN = 8  # rounds sat out (half a second each at best): time to look at the quarantine
BACK = 3 + COOLDOWN  # quarantined after round 2, let back in for this round
ROUNDS = BACK + 1
CUT = "ap-south"  # the partitioned region
#: Two regions: one to partition, one to carry the rounds with the quorum of one.
REGIONS = ("eu-west", CUT)
# Round 0's two arrivals are enough to adapt round 1's deadline; round 2 counts 1
# straggler in 4 samples (25%, no growth), round 3 2 in 6 (33%, grown). With k = 1 the
# spread of so few samples does not push the rounds waited out (1 and 2) past min_s.
DEADLINE = {
    "initial_s": 30.0,
    "min_s": 8.0,
    "max_s": 30.0,
    "min_samples": 2,
    "k": 1.0,
    "straggler_fraction": 0.3,
}
QUARANTINE = {"max_consecutive_bad": 2, "cooldown_rounds": COOLDOWN}
# The deadline's min_s must exceed the coordinator's upload_s.
COORDINATOR_TIMEOUTS = {
    "connect_s": 2,
    "heartbeat_s": 2,
    "request_s": 3,
    "upload_s": 6,
    "download_s": 6,
    "round_deadline_s": 60,
}
# A partitioned request gives up well within a round.
AGENT_TIMEOUTS = {
    "connect_s": 2,
    "heartbeat_s": 2,
    "request_s": 4,
    "upload_s": 8,
    "download_s": 8,
    "round_deadline_s": 60,
}


async def test_a_partitioned_region_straggles_is_quarantined_and_catches_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The coordinator's port is chosen by the harness: the proxy learns it from the config.
    slow = LinkSettings(latency_s=0.1)  # ap-south's round 1 cannot end before the cut
    async with WanProxy(
        "127.0.0.1", 0, "127.0.0.1", 1, seed=5, upstream=slow, downstream=slow
    ) as wan:

        def customize(name: str, data: dict[str, Any]) -> None:
            if name == "coordinator":
                wan.target_port = int(data["listen"]["port"])
                data["timeouts"] = COORDINATOR_TIMEOUTS
                data["quarantine"] = QUARANTINE
            elif name.startswith("agent-"):
                data["timeouts"] = AGENT_TIMEOUTS
                if name == f"agent-{CUT}":
                    data["coordinator_url"] = f"https://localhost:{wan.port}"
            elif name == "job":
                data["min_regions"] = 1
                data["deadline"] = DEADLINE
                data["evaluation"] = {"where": "none"}

        async with (
            running_federation(
                tmp_path,
                regions=REGIONS,
                rounds=ROUNDS,
                inner_steps=3,
                broker="mosquitto",
                customize=customize,
            ) as fed,
            ControlObserver.with_certificate(fed).running() as observer,
        ):
            await _scenario(fed, wan, observer, capsys)


async def _agents_ready(fed: FederationRun, timeout_s: float = 120.0) -> None:
    """Every agent's worker group is up, so round 0's arrivals measure a round."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fed.children.check_alive()
        regions = (await fed.get("/v1/regions"))["regions"]
        ready = {e["region"] for e in regions if e.get("detail") == "ready"}
        if ready >= set(fed.regions):
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"agents not ready within {timeout_s} s\n{fed.log_tails()}")


def _current(status: dict[str, Any]) -> int:
    """The round of the job's latest round record (-1 before the first one)."""
    current = status.get("current") or {}
    return int(current.get("round", -1))


async def _job_status_text(fed: FederationRun, capsys: pytest.CaptureFixture[str]) -> str:
    """What ``geofed job status`` prints for the job, run as an operator would."""
    operator = fed.federation.operator
    flags = ["--url", fed.base, "--cert", str(operator.cert), "--key", str(operator.key)]
    flags += ["--trust", str(fed.federation.trust_bundle)]
    capsys.readouterr()
    code = await asyncio.to_thread(main, ["job", "status", fed.job, *flags])
    out = capsys.readouterr().out
    assert code == 0, out
    return out


async def _scenario(
    fed: FederationRun,
    wan: WanProxy,
    observer: ControlObserver,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await _agents_ready(fed)
    status, body = await fed.submit()
    assert status == 201, body

    # Round 0 with everyone; cut ap-south off as soon as its delta is in.
    await fed.wait_for(
        lambda s: s["round"] > 0 or CUT in s.get("current", {}).get("delivered", []),
        timeout_s=120,
        what=f"{CUT}'s delta of round 0",
    )
    wan.partition()
    cut_at = time.monotonic()

    # Rounds 1 and 2 close at their deadline without ap-south; then it is quarantined.
    job = await fed.wait_for(
        lambda s: _current(s) >= 3, timeout_s=150, what="rounds 1 and 2 to close without ap-south"
    )
    # Healed while ap-south sits out its cool-down, so that it is reachable when let back in.
    wan.upstream = wan.downstream = LinkSettings()
    wan.heal(reset_existing=True)
    partition_s = time.monotonic() - cut_at
    healed_at = time.time()
    assert job["current"]["round"] < BACK, job
    assert CUT not in job["current"]["participants"], job
    assert CUT in job["quarantined"], job
    until = f"{CUT} is quarantined until round {BACK}: 2 consecutive bad rounds"
    assert job["quarantined"][CUT].startswith(until), job
    assert f"  {until}" in await _job_status_text(fed, capsys)
    regions = {entry["region"]: entry for entry in (await fed.get("/v1/regions"))["regions"]}
    assert set(regions[CUT]["quarantined"]) == {fed.job}, regions[CUT]
    assert all(not regions[r]["quarantined"] for r in fed.regions if r != CUT), regions
    metrics = await fed.metrics_text()
    assert sample(metrics, "geofed_region_quarantined", job=fed.job, region=CUT) == 1
    assert sample(metrics, "geofed_region_quarantined", job=fed.job, region="eu-west") == 0
    assert sample(metrics, "geofed_stragglers_total", job=fed.job, region=CUT) == 2
    assert sample(metrics, "geofed_stragglers_total", job=fed.job, region="eu-west") == 0

    # After the cool-down ap-south is let back in (on probation).
    job = await fed.wait_for(
        lambda s: _current(s) >= BACK, timeout_s=90, what=f"round {BACK} after the cool-down"
    )
    assert job["current"]["round"] == BACK, job
    assert CUT in job["current"]["participants"], job
    assert job["quarantined"] == {}, job
    metrics = await fed.metrics_text()
    assert sample(metrics, "geofed_region_quarantined", job=fed.job, region=CUT) == 0
    await fed.wait_for(
        lambda s: s.get("state") == "completed", timeout_s=120, what="the job to complete"
    )
    await stop_agents(fed)

    entries = await audit_entries(fed, job=fed.job)
    publications = {e.round: e.details for e in entries if e.action == "round.publish"}
    assert set(publications) == set(range(ROUNDS)), sorted(publications, key=str)
    assert len([e for e in entries if e.action == "round.publish"]) == ROUNDS  # once each
    stragglers = {r: tuple(d["stragglers"]) for r, d in publications.items()}
    assert stragglers == {r: (CUT,) if r in (1, 2) else () for r in range(ROUNDS)}, stragglers
    for round_ in range(3, BACK):
        assert CUT not in publications[round_]["included"], publications[round_]
    assert CUT in publications[BACK]["included"], publications[BACK]
    delivered = sorted((e.round, e.region) for e in entries if e.action == "delta.accept")
    assert [r for r, region in delivered if region == CUT] == [0, BACK], delivered
    back = next(
        e for e in entries if (e.action, e.region, e.round) == ("delta.accept", CUT, ROUNDS - 1)
    )
    catch_up_s = datetime.fromisoformat(back.time).timestamp() - healed_at

    # Announced deadlines: the initial one first, then adapted, always within bounds.
    deadlines: dict[int, float] = {}
    for a in observer.announcements:
        if a.job == fed.job and a.state == "open":
            deadlines.setdefault(a.round, a.deadline_s)
    assert set(deadlines) == set(range(ROUNDS)), deadlines
    assert deadlines[0] == pytest.approx(DEADLINE["initial_s"], abs=0.01)
    assert deadlines[1] < deadlines[0], deadlines
    # Rounds 1 and 2 each had one straggler: 2 of round 3's 6 samples (33% > 30%), so
    # its deadline grew to at least 1.5 x the last one, however fast the other was.
    assert deadlines[3] >= min(DEADLINE["max_s"], 1.5 * deadlines[2]) - 0.01, deadlines
    for round_, value in deadlines.items():
        assert DEADLINE["min_s"] - 0.01 <= value <= DEADLINE["max_s"] + 0.01, (round_, value)
    participants = {
        a.round: set(a.participants) for a in observer.announcements if a.job == fed.job
    }
    assert [r for r in range(ROUNDS) if CUT not in participants[r]] == list(range(3, BACK))

    # Every region trained the last round from the same θ_4, the one announced.
    final_base = next(
        a.base_hash for a in observer.announcements if a.job == fed.job and a.round == ROUNDS - 1
    )
    assert final_base == publications[ROUNDS - 2]["params_hash"]
    last: dict[str, set[str]] = {region: set() for region in fed.regions}
    for _, s in observer.statuses:
        if s.job == fed.job and s.round == ROUNDS - 1 and s.params_hash is not None:
            last[s.region].add(s.params_hash)
    assert last == {region: {final_base} for region in fed.regions}, last
    print(
        f"\npartition of {CUT}: {partition_s:.1f} s; deadlines by round "
        + ", ".join(f"{r}: {d:.1f} s" for r, d in sorted(deadlines.items()))
        + f"; rounds lost by {CUT}: 2 straggled + {COOLDOWN} quarantined; its delta of round "
        f"{BACK} "
        f"accepted {catch_up_s:.1f} s after the heal"
    )
