"""Two coordinators on one PostgreSQL state: the standby takes over, twice.

Coordinators A and B (real processes, real TLS, Mosquitto with mutual TLS, the
machine's real PostgreSQL with a fresh database, one state directory standing for a
shared filesystem) share a leader lease (``state_store.leader_lease``). Test code acting
as two regions feeds them the fixed deltas of ``tests/support/coordinator_daemon.py``.

1. A leads; B stands by. A is killed with SIGKILL mid-publication of round 1 (its update
   and snapshot stored, the publishing transaction not committed): B takes over and
   publishes round 1.
2. A is restarted and stands by. Mid-collection of round 2 (one region's delta
   accepted) B is frozen with SIGSTOP, a leader cut off from everything: A takes over,
   accepts the other region's delta and publishes the last round.
3. B is let go (SIGCONT): it finds its lease taken, writes nothing (its store is fenced)
   and exits with the runtime-error code, so that systemd would restart it as a standby.

What it proves: every round's update stream and θ hash are bit for bit those of an
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

import pytest

from tests.support.coordinator_daemon import (
    REGIONS,
    ROUNDS,
    WAIT_S,
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
        await a.deliver(PUBLISHED_ROUND)
        await a.wait_marker("publish", PUBLISHED_ROUND)

        # 1. The leader dies mid-publication.
        lost = time.monotonic()
        await a.kill()
        await b.wait_ready()
        first_takeover_s = time.monotonic() - lost
        await b.wait_published(PUBLISHED_ROUND)

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
