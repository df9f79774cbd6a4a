"""The leader lease and fencing on the machine's real PostgreSQL.

Two holders of one lease on a fresh database (``tests/support/stores.py:PostgresSpec``):
one leads, the other waits; after the leader's lease runs out the other takes over with
the next token, the old leader learns it has lost, and its store (opened with its
fence) can no longer write, while the new leader's can. The daemons' takeover is
covered with real coordinator processes in ``test_coordinator_failover.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.ha.lease import LeaseOutcome
from coordinator.ha.postgres_lease import PostgresLease
from coordinator.state.postgres import PostgresStore, StoreFenced
from tests.support.stores import B1, B2, JOB, PostgresSpec, with_job

pytestmark = pytest.mark.integration

TTL = 0.6


@pytest.fixture
def spec(tmp_path: Path) -> Iterator[PostgresSpec]:
    spec = PostgresSpec.fresh(tmp_path)
    yield spec
    spec.drop()


def test_a_standby_takes_over_an_expired_lease_and_the_old_leaders_writes_are_fenced(
    spec: PostgresSpec,
) -> None:
    first = PostgresLease(spec.dsn, "coordinator-a", ttl_s=TTL)
    second = PostgresLease(spec.dsn, "coordinator-b", ttl_s=TTL)
    try:
        assert first.attempt().outcome is LeaseOutcome.ACQUIRED
        waiting = second.attempt()
        assert waiting.outcome is LeaseOutcome.HELD_ELSEWHERE
        assert "coordinator-a" in waiting.reason
        assert first.fence is not None
        assert first.fence.token == 1
        assert second.fence is None

        old = PostgresStore(spec.dsn, fence=first.fence)
        with_job(old)
        old.set_pointer(JOB, "params", B1)

        time.sleep(TTL + 0.2)  # the leader stops renewing (it hangs, say)
        taken = second.attempt()
        assert taken.outcome is LeaseOutcome.ACQUIRED
        assert taken.lease.token == 2
        new = PostgresStore(spec.dsn, fence=second.fence)

        # The old leader has not noticed yet: its write is refused, and changes nothing.
        with pytest.raises(StoreFenced, match="token 1"):
            old.set_pointer(JOB, "params", B2)
        assert new.get_pointer(JOB, "params") == B1
        new.set_pointer(JOB, "params", B2)
        assert old.get_pointer(JOB, "params") == B2  # reads still work

        # When it asks, it learns it lost; releasing then does not touch the new lease.
        lost = first.attempt()
        assert lost.outcome is LeaseOutcome.LOST
        assert "coordinator-b holds token 2" in lost.reason
        assert first.release() is False
        assert second.attempt().outcome is LeaseOutcome.RENEWED
        old.close()
        new.close()
    finally:
        first.close()
        second.close()


def test_a_released_lease_is_taken_at_once_and_only_one_of_many_acquires(
    spec: PostgresSpec,
) -> None:
    leases = [PostgresLease(spec.dsn, f"coordinator-{i}", ttl_s=30.0) for i in range(4)]
    try:
        outcomes: list[LeaseOutcome] = [LeaseOutcome.LOST] * len(leases)
        barrier = threading.Barrier(len(leases))

        def contend(i: int) -> None:
            barrier.wait()
            outcomes[i] = leases[i].attempt().outcome

        threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(leases))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(outcomes) == sorted(
            [LeaseOutcome.ACQUIRED] + [LeaseOutcome.HELD_ELSEWHERE] * (len(leases) - 1)
        )
        leader = outcomes.index(LeaseOutcome.ACQUIRED)
        other = leases[(leader + 1) % len(leases)]
        assert other.attempt().outcome is LeaseOutcome.HELD_ELSEWHERE
        assert leases[leader].release() is True
        taken = other.attempt()  # no waiting for the 30 s lease to expire
        assert taken.outcome is LeaseOutcome.ACQUIRED
        assert taken.lease.token == 2
    finally:
        for lease in leases:
            lease.close()


def test_a_takeover_waits_for_the_old_leaders_transaction_in_progress(
    spec: PostgresSpec,
) -> None:
    first = PostgresLease(spec.dsn, "coordinator-a", ttl_s=TTL)
    second = PostgresLease(spec.dsn, "coordinator-b", ttl_s=TTL)
    old = None
    try:
        assert first.attempt().leading
        old = PostgresStore(spec.dsn, fence=first.fence)
        with_job(old)
        time.sleep(TTL + 0.2)  # the lease ran out; the old leader writes on regardless
        inside = threading.Event()

        def write_slowly() -> None:
            assert old is not None
            with old.transaction():  # checked token 1 under the writer lock: allowed
                old.set_pointer(JOB, "params", B1)
                inside.set()
                time.sleep(0.5)

        writer = threading.Thread(target=write_slowly)
        writer.start()
        assert inside.wait(10)
        started = time.monotonic()
        taken = second.attempt()  # waits for the old leader's commit
        waited = time.monotonic() - started
        writer.join()
        assert taken.outcome is LeaseOutcome.ACQUIRED
        assert waited >= 0.3, waited
        # What the new leader reads after taking over includes that committed write, and
        # nothing the old leader tries afterwards lands.
        new = PostgresStore(spec.dsn, fence=second.fence)
        assert new.get_pointer(JOB, "params") == B1
        with pytest.raises(StoreFenced):
            old.set_pointer(JOB, "params", B2)
        assert new.get_pointer(JOB, "params") == B1
        new.close()
    finally:
        if old is not None:
            old.close()
        first.close()
        second.close()
