"""Two coordinators on one PostgreSQL state: the standby takes over, twice.

Coordinators A and B (real processes, real TLS, Mosquitto with mutual TLS, the
machine's real PostgreSQL with a fresh database, one state directory standing for a
shared filesystem) share a leader lease (``state_store.leader_lease``). Test code acting
as two regions feeds them the fixed deltas of ``tests/support/coordinator_daemon.py``.

1. A leads; B stands by, answering reads from the shared state on its own port
   (``coordinator/api/standby.py``: a job's state and round as the leader shows them,
   ``/readyz`` 503 naming the leader, ``/metrics`` with ``geofed_coordinator_leader`` 0
   where the leader's has 1, writes 503 ``standby``, the leader's role rules).
   A is killed with SIGKILL mid-publication of round 1 (its update
   and snapshot stored, the publishing transaction not committed): B takes over and
   publishes round 1.
2. A is restarted and stands by. Mid-collection of round 2 (one region's delta
   accepted) B is frozen with SIGSTOP, a leader cut off from everything: A takes over,
   accepts the other region's delta and publishes the last round.
3. B is let go (SIGCONT): it finds its lease taken, writes nothing (its store is fenced)
   and exits with the runtime-error code, so that systemd would restart it as a standby.
4. B restarted stands by, serving reads, and SIGTERM stops it cleanly (exit 0).

With ``aggregation.late: merge``, a straggler's delta that leader A merged into the
round it was collecting survives A's SIGKILL: B, taking over, holds it, answers its retry
with the same receipt and publishes it once, at its staleness weight.

What the first test proves: every round's update stream and θ hash are bit for bit those of an
uninterrupted coordinator; each round is published once and each delta accepted once
(the accepted delta of round 2 survived its leader); the deposed leader did not write.
What it measures, and prints: the time from the leader's loss to the first request
answered by the new leader.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.coordinator import job_yaml, request
from tests.support.coordinator_daemon import (
    JOB,
    REGIONS,
    ROUNDS,
    WAIT_S,
    Daemon,
    deliver_one,
    lease_pair,
    log_text,
    outcome,
    run_reference,
    signal_group,
    standing_by,
)
from tests.support.pki import make_federation
from tests.support.stores import PostgresSpec
from tests.support.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TTL_S = 4.0
PUBLISHED_ROUND = 1  # A is killed publishing it
COLLECTED_ROUND = 2  # B is frozen collecting it


@pytest.fixture
def database(tmp_path: Path) -> Iterator[PostgresSpec]:
    spec = PostgresSpec.fresh(tmp_path)
    yield spec
    spec.drop()


async def test_a_standby_takes_over_mid_publication_and_mid_collection(
    tmp_path: Path, database: PostgresSpec
) -> None:
    fed = make_federation(tmp_path / "fed", "acme")
    reference = await run_reference(tmp_path / "reference", fed)

    async with lease_pair(tmp_path / "ha", fed, database.dsn, TTL_S) as (a, b):
        await a.start(fault=f"publish:{PUBLISHED_ROUND}")
        await b.start(wait_ready=False)
        await standing_by(b, 0)
        await a.submit()
        await a.deliver(0)
        await a.wait_published(0)
        await reads_on_standby(a, b)
        await a.deliver(PUBLISHED_ROUND)
        await a.wait_marker("publish", PUBLISHED_ROUND)

        # 1. The leader dies mid-publication.
        lost = time.monotonic()
        await a.kill()
        await b.wait_ready()
        first_takeover_s = time.monotonic() - lost
        led = await b.wait_published(PUBLISHED_ROUND)
        assert "served_by" not in led, led  # the full API, from the engine

        # 2. The old leader comes back as a standby; the new one freezes mid-collection.
        before = len(log_text(a))
        await a.start(wait_ready=False)
        await standing_by(a, before)
        await deliver_one(b, COLLECTED_ROUND, 0)
        frozen = time.monotonic()
        signal_group(b, signal.SIGSTOP)
        await a.wait_ready()
        second_takeover_s = time.monotonic() - frozen
        await deliver_one(a, COLLECTED_ROUND, 1)  # the first region's delta survived
        await a.wait_published(COLLECTED_ROUND)
        done = await outcome(a)
        entries = await a.audit()

        # 3. The deposed leader wakes up, finds the lease gone and stops, writing nothing.
        signal_group(b, signal.SIGCONT)
        assert b.child is not None
        code = await asyncio.wait_for(b.child.wait(), WAIT_S)
        assert code == 1, log_text(b)
        assert "deposed: lost: " in log_text(b), log_text(b)
        await b.forget()
        assert [e.seq for e in await a.audit()] == [e.seq for e in entries]

        # 4. Restarted, it stands by serving reads; SIGTERM stops it cleanly.
        before = len(log_text(b))
        await b.start(wait_ready=False)
        await standing_by(b, before)
        status, ready = await request(b.session(b.setup.observer), "GET", "/readyz")
        assert (status, ready["served_by"]) == (503, "standby"), ready
        signal_group(b, signal.SIGTERM)
        assert await asyncio.wait_for(b.child.wait(), WAIT_S) == 0, log_text(b)
        await b.forget()

    for round_ in range(ROUNDS):
        assert done.updates[round_] == reference.updates[round_], f"round {round_} differs"
    assert done.final_hash == reference.final_hash
    published = [e.round for e in entries if e.action == "round.publish"]
    assert published == list(range(ROUNDS)), published
    accepted = sorted((e.round, e.region) for e in entries if e.action == "delta.accept")
    assert accepted == [(r, name) for r in range(ROUNDS) for name in REGIONS], accepted
    print(
        f"\nleader lease ttl {TTL_S} s: standby serving {first_takeover_s:.1f} s after the "
        f"leader was killed mid-publication, {second_takeover_s:.1f} s after the next "
        "leader froze mid-collection; no round applied twice, no delta re-sent"
    )


async def reads_on_standby(leader: Daemon, standby: Daemon) -> None:
    """The standby answers reads as the leader does and refuses the rest, naming it."""
    observer = standby.session(standby.setup.observer)
    shared = ("state", "round", "rounds", "params_hash", "regions", "current", "spec")
    views: list[tuple[dict[str, Any], dict[str, Any]]] = []

    async def same_view() -> bool:
        # Read in turn: the leader may open the next round between the two reads.
        led = await leader.job()
        status, seen = await request(observer, "GET", f"/v1/jobs/{JOB}")
        assert status == 200, seen
        assert seen.pop("served_by") == "standby"
        views.append(({k: seen[k] for k in shared}, led))
        return views[-1][0] == {k: led[k] for k in shared}

    try:
        await eventually(same_view, 15)
    except TimeoutError:
        seen, led = views[-1]
        assert seen == {k: led[k] for k in shared}
    led = views[-1][1]
    status, listed = await request(observer, "GET", "/v1/jobs")
    assert status == 200, listed
    assert [(j["job"], j["round"]) for j in listed["jobs"]] == [(JOB, led["round"])]
    status, trail = await request(observer, "GET", f"/v1/audit?job={JOB}&verify=1")
    assert status == 200, trail
    assert trail["verify"]["ok"], trail
    assert [e.seq for e in await leader.audit()] == [e["seq"] for e in trail["entries"]]
    assert (await request(observer, "GET", "/healthz"))[0] == 200

    status, ready = await request(observer, "GET", "/readyz")
    assert (status, ready["ready"]) == (503, False), ready
    assert f"leading as {ready['leader']}:" in log_text(leader), ready
    # Prometheus scrapes each at its own address: the standby is up and says it stands by.
    for daemon, leads in ((leader, 1.0), (standby, 0.0)):
        async with daemon.session(daemon.setup.observer).get("/metrics") as response:
            assert response.status == 200, await response.text()
            scraped = await response.text()
        assert f"geofed_coordinator_leader {leads}\n" in scraped, scraped
    assert f'geofed_coordinator_standby_info{{leader="{ready["leader"]}"}} 1.0' in scraped
    operator = standby.session(standby.setup.operator)
    status, refused = await request(operator, "POST", "/v1/jobs", data="job: x")
    assert (status, refused["error"]) == (503, "standby"), refused
    assert ready["leader"] in refused["message"]
    # A region: refused what the leader refuses it, shown only its own job, as there.
    for daemon in (leader, standby):
        region = daemon.session(daemon.setup.regions[REGIONS[0]])
        status, body = await request(region, "GET", "/v1/jobs")
        assert (status, body["error"]) == (403, "forbidden"), body
        status, body = await request(region, "GET", f"/v1/jobs/{JOB}")
        assert (status, body["round"], "spec" in body) == (200, led["round"], False), body


MERGING = "min_regions: 1\naggregation: {late: merge, max_staleness: 1, grace_s: 1.0}\n"


async def test_a_late_delta_merged_by_a_leader_that_dies_is_published_once_by_the_next(
    tmp_path: Path, database: PostgresSpec
) -> None:
    """``aggregation.late: merge`` across a failover: a straggler's delta that leader A
    merged into the round it was collecting reaches θ once, through B, after A's SIGKILL.
    """
    fed = make_federation(tmp_path / "fed", "acme")
    async with lease_pair(tmp_path / "ha", fed, database.dsn, TTL_S) as (a, b):
        await a.start()
        await b.start(wait_ready=False)
        await standing_by(b, 0)
        operator = a.session(a.setup.operator)
        spec = job_yaml(JOB, rounds=ROUNDS, extra=MERGING)
        status, body = await request(operator, "POST", "/v1/jobs", data=spec)
        assert status == 201, body
        await a.deliver(0)
        # Round 1: us-east straggles; the round closes a second after eu-west's delta.
        opened = await a.wait_job(
            "round 1 to collect",
            lambda s: s["round"] == 1 and s.get("current", {}).get("phase") == "collecting",
        )
        await deliver_one(a, 1, 0)
        await a.wait_published(1)
        late = a.region("us-east").delta(JOB, 1, opened["params_hash"], seed=4, tokens=300)
        status, merged = await a.region("us-east").three_step(JOB, 1, *late)
        assert (status, merged["state"]) == (200, "accepted"), merged
        assert (await a.job())["current"]["merged"] == [{"region": "us-east", "round": 1}]

        # A dies collecting round 2, the late delta merged into it.
        await a.kill()
        await b.wait_ready()
        assert (await b.job())["current"]["merged"] == [{"region": "us-east", "round": 1}]
        status, again = await b.region("us-east").single_shot(JOB, 1, *late)  # a retry
        assert (status, again["receipt"]) == (200, merged["receipt"]), again
        await b.deliver(2)
        await b.wait_published(2)
        entries = await b.audit()

    accepted = [(e.round, e.region) for e in entries if e.action == "delta.accept"]
    assert sorted(accepted) == [(r, name) for r in range(ROUNDS) for name in REGIONS], accepted
    (late_accept,) = [
        e for e in entries if e.action == "delta.accept" and e.round == 1 and e.region == "us-east"
    ]
    assert late_accept.details["merged_into"] == 2, late_accept.details
    publications = {e.round: e.details for e in entries if e.action == "round.publish"}
    assert [e.round for e in entries if e.action == "round.publish"] == list(range(ROUNDS))
    assert publications[1]["stragglers"] == ["us-east"], publications[1]
    assert sorted(publications[2]["order"]) == ["eu-west", "us-east", "us-east@1"]
    assert publications[2]["tokens"] == 100 + 300 + 300  # the late delta's tokens reached θ
