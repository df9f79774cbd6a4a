"""The leader lease's decisions and its configuration, without a database."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from coordinator.config import LeaderLeaseConfig, StateStoreConfig
from coordinator.ha.lease import Lease, LeaseOutcome, decide, step_down_reason

TTL = 10.0
NOBODY = Lease("", 0, 0.0)


@pytest.mark.parametrize(
    ("current", "holder", "held", "now", "outcome", "token", "expires", "reason"),
    [
        # Nobody ever held it: the first to ask takes token 1.
        (NOBODY, "a", None, 100.0, LeaseOutcome.ACQUIRED, 1, 110.0, "first holder"),
        # Held and unexpired: a standby waits, told whom and for how long.
        (Lease("a", 1, 105.0), "b", None, 100.0, LeaseOutcome.HELD_ELSEWHERE, 1, 105.0, "5.0 s"),
        # Expired: a standby takes it with the next token.
        (Lease("a", 1, 99.0), "b", None, 100.0, LeaseOutcome.ACQUIRED, 2, 110.0, "a's lease"),
        # Exactly at expiry counts as expired.
        (Lease("a", 1, 100.0), "b", None, 100.0, LeaseOutcome.ACQUIRED, 2, 110.0, "expired"),
        # The leader renews with its token.
        (Lease("a", 3, 105.0), "a", 3, 100.0, LeaseOutcome.RENEWED, 3, 110.0, "renewed"),
        # Expired but nobody took it: same token, renewed.
        (Lease("a", 3, 90.0), "a", 3, 100.0, LeaseOutcome.RENEWED, 3, 110.0, "nobody took it"),
        # Taken over: a new token in the row, the old leader has lost it.
        (Lease("b", 4, 105.0), "a", 3, 100.0, LeaseOutcome.LOST, 4, 105.0, "b holds token 4"),
        # Taken over and released again by the other: still lost (the token moved on).
        (Lease("b", 4, 0.0), "a", 3, 100.0, LeaseOutcome.LOST, 4, 0.0, "held token 3"),
        # A restarted process under the same name but without the token does not renew.
        (Lease("a", 3, 105.0), "a", None, 100.0, LeaseOutcome.HELD_ELSEWHERE, 3, 105.0, "a leads"),
    ],
)
def test_decide(
    current: Lease,
    holder: str,
    held: int | None,
    now: float,
    outcome: LeaseOutcome,
    token: int,
    expires: float,
    reason: str,
) -> None:
    decision = decide(current, holder, held, now, TTL)
    assert decision.outcome is outcome
    assert decision.leading is (outcome in (LeaseOutcome.ACQUIRED, LeaseOutcome.RENEWED))
    assert decision.lease.token == token
    assert decision.lease.expires_at == expires
    if decision.leading:
        assert decision.lease.holder == holder
    assert reason in decision.reason


def test_tokens_only_grow_across_takeovers() -> None:
    lease, tokens = NOBODY, []
    for i, holder in enumerate("abcab"):
        now = 100.0 * (i + 1)  # each ask comes after the previous lease expired
        decision = decide(lease, holder, None, now, TTL)
        assert decision.outcome is LeaseOutcome.ACQUIRED
        lease = decision.lease
        tokens.append(lease.token)
    assert tokens == [1, 2, 3, 4, 5]


def test_a_non_positive_ttl_is_refused() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        decide(NOBODY, "a", None, 0.0, 0.0)


def test_step_down_only_once_the_renewal_ran_out() -> None:
    assert step_down_reason(9.9, 10.0) is None
    reason = step_down_reason(12.5, 10.0)
    assert reason is not None
    assert "2.5 s ago" in reason


def test_lease_config_defaults_and_limits() -> None:
    config = LeaderLeaseConfig()
    assert config.ttl_s == 15.0
    assert config.renew_interval_s == 5.0
    with pytest.raises(ValidationError, match="at most half of ttl_s"):
        LeaderLeaseConfig(ttl_s=10, renew_every_s=6)
    with pytest.raises(ValidationError, match="needs kind: postgresql"):
        StateStoreConfig.model_validate({"kind": "sqlite", "leader_lease": {}})
    store = StateStoreConfig.model_validate(
        {"kind": "postgresql", "dsn": "host=db dbname=geofed", "leader_lease": {"ttl_s": 6}}
    )
    assert store.leader_lease is not None
    assert store.leader_lease.renew_interval_s == 2.0
