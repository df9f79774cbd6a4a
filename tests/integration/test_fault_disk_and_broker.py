"""A full disk under a region's job state, then the MQTT broker restarted mid-job.

One real federation (the embedded broker in the test's event loop, coordinator and two
agents as processes, mutual TLS, SQLite) runs two jobs in turn.

* **A full disk.** eu-west's directory of the first job (θ files, the spool, the
  residual) is a small tmpfs (mounted for the test, a real filesystem that really runs
  out of space), filled while round 0 trains, so spooling its delta fails with ENOSPC (or,
  if the round was quicker, saving the next θ does). The agent reports the round's error
  with the reason and a retry, leaves no partial delta behind, and keeps running (the
  daemon once exited on it, and systemd restarted it until its limit). Once the test frees
  the disk, the retry spools and sends the delta and the job completes with every
  region's delta of every round.
* **A broker restart.** Once both agents work on round 1 of the second job the broker is
  stopped; the deltas of round 1 still travel over HTTPS, so the coordinator publishes
  round 1 and announces round 2 while nobody can hear it. A few seconds later a fresh
  broker (no retained messages: it lost them all) starts on the same port. The
  coordinator and both agents notice the loss (their connection gauges drop to 0) and
  reconnect with back-off; the coordinator re-publishes the retained announcement of
  round 2, the agents re-publish their statuses, and training completes; every round is
  published exactly once and each region's delta of each round accepted exactly once;
  every status reports the θ_r that round r's publication produced, and both regions end
  holding the same parameters.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import pytest

from geofed.backoff import Backoff
from tests.support.disks import ENOSPC_TEXT, fill, tmpfs
from tests.support.federation import FederationRun
from tests.support.observe import (
    WAIT_S,
    ControlObserver,
    agent_metrics,
    audit_entries,
    check_others_alive,
    held_params,
    observed_federation,
    poll,
    sample,
    wait_job,
)
from tests.support.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REGIONS = ("eu-west", "us-east")
#: The full-disk job (the federation's own): enough inner steps that the disk fills while
#: round 0 trains.
DISK_JOB, DISK_ROUNDS, DISK_INNER_STEPS = "charlm-demo", 2, 40
BROKER_JOB, BROKER_ROUNDS, BROKER_INNER_STEPS = "broker-restart", 4, 3
#: How long the broker stays down after the coordinator published a round without it.
OUTAGE_S = 5.0
#: How long a daemon may take to notice the broker is gone (a few MQTT keep-alives).
GAUGE_DROP_S = 15.0


async def mqtt_gauges(fed: FederationRun) -> dict[str, float]:
    """Each daemon's MQTT connection gauge, from its own ``/metrics``."""
    gauges = {"coordinator": sample(await fed.metrics_text(), "geofed_mqtt_connected")}
    for region in REGIONS:
        text = await agent_metrics(fed, region)
        gauges[region] = sample(text, "geofed_agent_mqtt_connected", region=region)
    return gauges


async def mqtt_gauges_are(fed: FederationRun, expected: dict[str, float]) -> bool:
    return await mqtt_gauges(fed) == expected


def connections(fed: FederationRun, name: str) -> int:
    """How many times the daemon's log says its MQTT connection came up."""
    text = (fed.work / "logs" / f"{name}.log").read_text()
    return sum(1 for line in text.splitlines() if "geofed.control.client: connected to" in line)


async def a_full_spool_disk_is_retried_not_fatal(
    fed: FederationRun, observer: ControlObserver, job_dir: Path
) -> None:
    def training() -> bool:
        return any(
            s.region == "eu-west" and s.job == DISK_JOB and s.state == "training"
            for _, s in observer.statuses
        )

    def refused_for_space() -> bool:
        return any(
            s.region == "eu-west" and s.state == "error" and ENOSPC_TEXT in s.detail
            for _, s in observer.statuses
        )

    await poll(fed, training, "eu-west to train round 0")
    filler = fill(job_dir)
    await poll(fed, refused_for_space, "eu-west to report its full disk")
    [error] = {
        s.detail
        for _, s in observer.statuses
        if s.region == "eu-west" and s.state == "error" and ENOSPC_TEXT in s.detail
    } or {""}
    assert error.startswith("will retry: local storage:"), error
    # Nothing half-written stays in the spool.
    spooled = sorted((job_dir / "spool").glob("round-*/*"))
    assert all(
        p.name == "manifest.json" or p.with_name("manifest.json").exists() for p in spooled
    ), spooled
    check_others_alive(fed, killed=None)
    filler.unlink()
    final = await fed.wait_completed(timeout_s=WAIT_S)
    check_others_alive(fed, killed=None)

    assert final["round"] == DISK_ROUNDS
    for region in REGIONS:
        assert all(observer.accepted(region, r, DISK_JOB) for r in range(DISK_ROUNDS)), region


async def a_broker_restart_loses_nothing_and_repeats_nothing(
    fed: FederationRun, observer: ControlObserver
) -> None:
    job = BROKER_JOB
    spec = {**fed.job_spec(), "job": job, "rounds": BROKER_ROUNDS}
    status, body = await fed.submit({**spec, "inner_steps": BROKER_INNER_STEPS})
    assert status == 201, body
    await wait_job(fed, lambda s: int(s.get("round", 0)) >= 1, "θ_1", job=job)
    assert await mqtt_gauges(fed) == dict.fromkeys(("coordinator", *REGIONS), 1.0)

    def working_on_round_1(region: str) -> bool:
        return any(
            s.region == region and s.job == job and (s.round or 0) >= 1
            for _, s in observer.statuses
        )

    # θ_1 is published before round 1's announcement reaches the agents: a broker
    # stopped in between would take the announcement with it, and round 1 would wait
    # for the broker that this test restarts only once round 1 is published.
    await poll(fed, lambda: all(working_on_round_1(r) for r in REGIONS), "round 1 begun")

    await fed.stop_broker()
    stopped_at = time.monotonic()
    await wait_job(fed, lambda s: int(s["round"]) >= 2, "round 1 to be published", job=job)
    published_down = time.monotonic() - stopped_at
    # The round may be published before a daemon's keep-alive notices the loss: each
    # gauge must drop within a few keep-alives, not at once.
    all_down = dict.fromkeys(("coordinator", *REGIONS), 0.0)
    try:
        await eventually(lambda: mqtt_gauges_are(fed, all_down), timeout_s=GAUGE_DROP_S)
    except TimeoutError:
        raise AssertionError(f"gauges did not drop: {await mqtt_gauges(fed)}") from None
    await asyncio.sleep(max(0.0, OUTAGE_S - (time.monotonic() - stopped_at)))

    started_wall = datetime.now(UTC)
    await fed.start_broker()
    started_at = time.monotonic()
    while sample(await fed.metrics_text(), "geofed_mqtt_connected") != 1.0:
        assert time.monotonic() - started_at < WAIT_S, "the coordinator did not reconnect"
        await asyncio.sleep(0.1)
    coordinator_back = time.monotonic() - started_at

    def back(region: str) -> bool:
        return any(
            s.region == region and s.state != "offline" and s.sent_at >= started_wall
            for _, s in observer.statuses
        )

    await poll(fed, lambda: all(back(r) for r in REGIONS), "every agent online again")
    agents_back = max(
        min(s.sent_at for _, s in observer.statuses if s.region == r and s.sent_at >= started_wall)
        for r in REGIONS
    )

    final = await wait_job(
        fed, lambda s: s.get("state") == "completed", f"{job} to complete", job=job
    )
    entries = await audit_entries(fed, job=job, verify=True)
    up = await mqtt_gauges(fed)
    reconnected = {"coordinator": connections(fed, "coordinator")}
    reconnected.update({r: connections(fed, f"agent-{r}") for r in REGIONS})

    assert up == dict.fromkeys(("coordinator", *REGIONS), 1.0), up
    # The round engine never waited for the broker (it skips announcements while the link
    # is down, "not delivered now", and re-sends the latest on reconnect); whether it had
    # one to skip depends on when the outage began relative to round 1's publication.
    log = (fed.work / "logs" / "coordinator.log").read_text()
    assert "not acknowledged within" not in log
    # Each daemon connected twice: at its start and after the restart.
    assert reconnected == dict.fromkeys(("coordinator", *REGIONS), 2), reconnected
    assert final["round"] == BROKER_ROUNDS

    # Every round published exactly once, each region's delta of each round taken once.
    publishes = [e for e in entries if e.action == "round.publish"]
    assert [e.round for e in publishes] == list(range(BROKER_ROUNDS))
    accepts = sorted((e.round, e.region) for e in entries if e.action == "delta.accept")
    assert accepts == [(r, g) for r in range(BROKER_ROUNDS) for g in sorted(REGIONS)]

    # θ_{r+1} is what round r's publication recorded; θ_0 is what round 0 was announced with.
    theta = {0: next(a.base_hash for a in observer.announcements if a.job == job and a.round == 0)}
    theta.update({int(e.round or 0) + 1: str(e.details["params_hash"]) for e in publishes})
    assert theta[BROKER_ROUNDS] == final["params_hash"]
    reported: dict[tuple[int, str], set[str]] = defaultdict(set)
    for _, s in observer.statuses:
        if s.job == job and s.round is not None and s.params_hash is not None:
            reported[(s.round, s.region)].add(s.params_hash)
    last = BROKER_ROUNDS - 1
    for (round_, region), hashes in reported.items():
        assert hashes == {theta[round_]}, (round_, region, hashes)
    for region in REGIONS:
        # Seen after the restart too, and the same θ on disk at the end.
        assert reported[(last, region)] == {theta[last]}, region
        assert held_params(fed, region, job) == {"round": last, "hash": theta[last]}

    announced_after = sorted(
        {a.round for a in observer.announcements if a.job == job and a.state == "open"}
        - set(range(2))
    )
    print(
        f"\nbroker restart: down {OUTAGE_S:.0f}+ s; round 1 published {published_down:.1f} s "
        "after the stop, without the broker; "
        f"rounds announced after the restart {announced_after}; broker start to every agent's "
        f"first status {(agents_back - started_wall).total_seconds():.1f} s, to the "
        f"coordinator connected {coordinator_back:.1f} s"
    )


async def test_a_full_disk_is_retried_and_a_broker_restart_loses_nothing(tmp_path: Path) -> None:
    job_dir = tmp_path / "agents" / "eu-west" / "jobs" / DISK_JOB
    with tmpfs(job_dir, size="8m"):
        # The observer comes back quickly, to see as much as possible after the restart.
        async with observed_federation(
            tmp_path,
            backoff=Backoff(initial_s=0.1, max_s=0.5),
            regions=REGIONS,
            rounds=DISK_ROUNDS,
            inner_steps=DISK_INNER_STEPS,
        ) as (fed, observer):
            assert fed.job == DISK_JOB
            await a_full_spool_disk_is_retried_not_fatal(fed, observer, job_dir)
            await a_broker_restart_loses_nothing_and_repeats_nothing(fed, observer)
