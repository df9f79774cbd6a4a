"""Who leads among coordinators sharing one state database: the lease decisions, pure.

A lease is one row: its ``holder``, a ``token`` that grows by one with every new holder
(the fencing token) and the time it ``expires_at``, on the database server's clock so
coordinators on machines whose clocks disagree still agree on expiry. A coordinator that
does not lead takes the lease once it has expired (a standby waits until then); the
leader renews it before it expires. A leader that finds the row changed under it (a new
token: someone took over) has lost it and must stop; one whose lease expired but whose
token is unchanged renews it, since nobody else led meanwhile.

Fencing: every write of the leader's state store is checked against the token it holds
(:class:`Fence`), so a deposed leader that still runs cannot change the state even
before it notices.

Nothing here does I/O; :mod:`coordinator.ha.postgres_lease` reads and writes the row.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Fence", "Lease", "LeaseDecision", "LeaseOutcome", "decide", "step_down_reason"]


@dataclass(frozen=True, slots=True)
class Lease:
    """The lease row: ``holder`` ('' when nobody ever held it), fencing token, expiry."""

    holder: str
    token: int
    expires_at: float


@dataclass(frozen=True, slots=True)
class Fence:
    """What a leader's store checks each write against: the lease's name and its token."""

    name: str
    token: int


class LeaseOutcome(StrEnum):
    ACQUIRED = "acquired"
    RENEWED = "renewed"
    HELD_ELSEWHERE = "held_elsewhere"
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class LeaseDecision:
    """What to do with the row; ``lease`` is the row to write (or the row as found)."""

    outcome: LeaseOutcome
    lease: Lease
    reason: str

    @property
    def leading(self) -> bool:
        return self.outcome in (LeaseOutcome.ACQUIRED, LeaseOutcome.RENEWED)


def decide(
    current: Lease, holder: str, held_token: int | None, now: float, ttl_s: float
) -> LeaseDecision:
    """The decision of ``holder`` (leading with ``held_token``, or not: None) at ``now``."""
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
    renewed = Lease(holder, current.token, now + ttl_s)
    if held_token is not None:
        if current.holder == holder and current.token == held_token:
            if current.expires_at <= now:
                return LeaseDecision(
                    LeaseOutcome.RENEWED, renewed, "renewed after it expired: nobody took it over"
                )
            return LeaseDecision(LeaseOutcome.RENEWED, renewed, "renewed")
        return LeaseDecision(
            LeaseOutcome.LOST,
            current,
            f"lost: {current.holder or 'nobody'} holds token {current.token}, "
            f"this coordinator held token {held_token}",
        )
    if current.expires_at <= now:
        taken = Lease(holder, current.token + 1, now + ttl_s)
        before = (
            f"after {current.holder}'s lease (token {current.token}) expired"
            if current.holder
            else "first holder"
        )
        return LeaseDecision(
            LeaseOutcome.ACQUIRED, taken, f"acquired token {taken.token}, {before}"
        )
    return LeaseDecision(
        LeaseOutcome.HELD_ELSEWHERE,
        current,
        f"{current.holder} leads (token {current.token}) for another "
        f"{current.expires_at - now:.1f} s unless it renews",
    )


def step_down_reason(now: float, valid_until: float) -> str | None:
    """Why a leader that could not renew must stop serving by ``now`` (None: not yet).

    ``valid_until`` is when its last renewal runs out on its own monotonic clock, less a
    margin for clock drift and the time its last renewal took to commit.
    """
    if now < valid_until:
        return None
    return (
        f"the leader lease could not be renewed and ran out {now - valid_until:.1f} s ago; "
        "a standby may lead now"
    )
