"""The daemon's side of the leader lease, against a scripted lease row (a fake database).

The row itself, on a real PostgreSQL, is tested in tests/integration/test_leader_lease.py;
two daemons taking over from each other in tests/integration/test_coordinator_failover.py.
Here: standing by until the lease is had, renewing, and stepping down when the lease is
lost or cannot be renewed before it runs out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from coordinator.config import LeaderLeaseConfig
from coordinator.ha.leadership import Leadership
from coordinator.ha.lease import Fence, Lease, LeaseDecision, LeaseOutcome
from coordinator.state.store import StoreFailure
from geofed.sdnotify import Notifier

CONFIG = LeaderLeaseConfig(ttl_s=0.3)  # renewed every 0.1 s


class ScriptedLease:
    """A fake lease row: each attempt takes the next outcome (or error) of a script."""

    holder = "coordinator-a"

    def __init__(self, script: Iterator[LeaseOutcome | Exception]) -> None:
        self._script = script
        self.attempts = 0
        self.released = False
        self._token: int | None = None

    @property
    def fence(self) -> Fence | None:
        return None if self._token is None else Fence("coordinator", self._token)

    def attempt(self) -> LeaseDecision:
        self.attempts += 1
        step = next(self._script)
        if isinstance(step, Exception):
            raise step
        leading = step in (LeaseOutcome.ACQUIRED, LeaseOutcome.RENEWED)
        self._token = 7 if leading else None
        return LeaseDecision(step, Lease("someone", 7, 0.0), f"scripted {step.value}")

    def release(self) -> bool:
        self.released = self._token is not None
        return self.released

    def close(self) -> None:
        pass


def _forever(step: LeaseOutcome | Exception) -> Iterator[LeaseOutcome | Exception]:
    while True:
        yield step


async def test_a_standby_waits_until_it_acquires_and_gets_the_fence() -> None:
    script: list[LeaseOutcome | Exception] = [
        LeaseOutcome.HELD_ELSEWHERE,
        StoreFailure("db down"),
        LeaseOutcome.ACQUIRED,
    ]
    lease = ScriptedLease(iter(script))
    fence = await Leadership(lease, CONFIG, Notifier(None)).acquire(asyncio.Event())
    assert fence == Fence("coordinator", 7)
    assert lease.attempts == 3


async def test_a_stop_ends_the_wait_without_leading() -> None:
    lease = ScriptedLease(_forever(LeaseOutcome.HELD_ELSEWHERE))
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.25, stop.set)
    assert await Leadership(lease, CONFIG, Notifier(None)).acquire(stop) is None


async def test_a_lost_lease_deposes_at_once() -> None:
    lease = ScriptedLease(iter([LeaseOutcome.ACQUIRED, LeaseOutcome.RENEWED, LeaseOutcome.LOST]))
    leadership = Leadership(lease, CONFIG, Notifier(None))
    assert await leadership.acquire(asyncio.Event()) is not None
    reasons: list[str] = []
    await asyncio.wait_for(leadership.hold(reasons.append), 5)
    assert reasons == ["scripted lost"]


async def test_a_leader_that_cannot_renew_steps_down_once_its_lease_ran_out() -> None:
    failures = _forever(StoreFailure("connection refused"))
    lease = ScriptedLease(iter([LeaseOutcome.ACQUIRED, *[next(failures) for _ in range(50)]]))
    leadership = Leadership(lease, CONFIG, Notifier(None))
    assert await leadership.acquire(asyncio.Event()) is not None
    started = asyncio.get_running_loop().time()
    reasons: list[str] = []
    await asyncio.wait_for(leadership.hold(reasons.append), 5)
    held = asyncio.get_running_loop().time() - started
    (reason,) = reasons
    assert "could not be renewed" in reason
    assert "connection refused" in reason
    # Not before 90% of the ttl since the last renewal, and soon after it.
    assert 0.27 <= held < 1.0, held


async def test_a_transient_failure_does_not_depose() -> None:
    script: list[LeaseOutcome | Exception] = [LeaseOutcome.ACQUIRED, StoreFailure("blip")]
    script += [LeaseOutcome.RENEWED] * 100
    leadership = Leadership(ScriptedLease(iter(script)), CONFIG, Notifier(None))
    assert await leadership.acquire(asyncio.Event()) is not None
    reasons: list[str] = []
    holding = asyncio.create_task(leadership.hold(reasons.append))
    await asyncio.sleep(0.6)  # two ttls
    assert not holding.done()
    holding.cancel()
    with pytest.raises(asyncio.CancelledError):
        await holding
    assert reasons == []


async def test_a_clean_stop_releases_the_lease() -> None:
    lease = ScriptedLease(iter([LeaseOutcome.ACQUIRED]))
    leadership = Leadership(lease, CONFIG, Notifier(None))
    assert await leadership.acquire(asyncio.Event()) is not None
    await leadership.release()
    assert lease.released
