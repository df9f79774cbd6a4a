"""The coordinator's residency gate: decides, counts, audits, and refuses on request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from coordinator.errors import ApiError
from coordinator.executors import Executors
from coordinator.metrics import CoordinatorMetrics
from coordinator.residency import ResidencyGate, policy_denied
from coordinator.state.async_store import AsyncStore
from coordinator.state.sqlite import SqliteStore
from geofed.types import ArtifactKind, Identity, Role
from policies import PolicySet, Provenance, Transfer, decide_transfer, load_policies

POLICY_DIR = Path(__file__).resolve().parents[2] / "configs" / "policies"
EU = Identity("acme", Role.REGION, "eu-west")


@pytest.fixture(scope="module")
def policies() -> PolicySet:
    return load_policies([POLICY_DIR])


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[AsyncStore]:
    executors = Executors(compute_threads=1, file_threads=1)
    db = await AsyncStore.open(lambda: SqliteStore.in_state_dir(tmp_path), executors)
    yield db
    await db.close()
    executors.shutdown()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def gate(policies: PolicySet, db: AsyncStore, registry: CollectorRegistry) -> ResidencyGate:
    return ResidencyGate(policies, db, CoordinatorMetrics(registry))


def _delta_to(policies: PolicySet, destination: str) -> Transfer:
    """eu-west's model delta going to ``destination`` (the coordinator sits in the EU)."""
    return Transfer(
        ArtifactKind.MODEL_DELTA,
        policies.endpoint("region:eu-west", "EU"),
        policies.endpoint(destination, "EU"),
        Provenance.regions("eu-west"),
    )


def _counted(registry: CollectorRegistry, verdict: str) -> float | None:
    labels = {"kind": "model_delta", "verdict": verdict}
    return registry.get_sample_value("geofed_policy_decisions_total", labels)


async def test_an_allowed_transfer_is_counted_audited_and_passes(
    gate: ResidencyGate, db: AsyncStore, policies: PolicySet, registry: CollectorRegistry
) -> None:
    transfer = _delta_to(policies, "coordinator")
    decision = await gate.enforce(
        transfer, what="this delta", actor=EU, job="job-a", round=3, region="eu-west"
    )
    assert decision == decide_transfer(policies, transfer)
    assert decision.allowed
    assert (_counted(registry, "allow"), _counted(registry, "deny")) == (1.0, 0.0)
    [entry] = await db.audit_entries()
    assert (entry.actor, entry.action, entry.verdict) == (EU.uri, "policy.model_delta", "allow")
    assert (entry.job, entry.round, entry.region) == ("job-a", 3, "eu-west")
    assert entry.details == decision.as_dict()


async def test_enforce_refuses_a_denied_transfer_naming_the_rule(
    gate: ResidencyGate, db: AsyncStore, policies: PolicySet, registry: CollectorRegistry
) -> None:
    transfer = _delta_to(policies, "region:us-east")
    with pytest.raises(ApiError) as refused:
        await gate.enforce(
            transfer, what="this delta", actor=EU, job="job-a", round=3, region="eu-west"
        )
    decision = decide_transfer(policies, transfer)
    rule = decision.rule
    assert (refused.value.status, refused.value.code) == (403, "policy_denied")
    assert refused.value.message == (
        f"residency policy refuses this delta: {decision.reason} "
        f"[rule {rule.rule_id} at {rule.origin}]"
    )
    assert refused.value.extra == {"rule": rule.rule_id, "origin": rule.origin}
    assert rule.rule_id == "eu-west:exports.model_delta[default]"
    # refused, yet decided once: counted and audited before the refusal
    assert (_counted(registry, "allow"), _counted(registry, "deny")) == (0.0, 1.0)
    [entry] = await db.audit_entries()
    assert (entry.action, entry.verdict, entry.details["rule"]) == (
        "policy.model_delta",
        "deny",
        rule.rule_id,
    )


async def test_decide_returns_a_denial_for_the_caller_to_act_on(
    gate: ResidencyGate, db: AsyncStore, policies: PolicySet, registry: CollectorRegistry
) -> None:
    decision = await gate.decide(
        _delta_to(policies, "region:us-east"), actor="coordinator", job="job-a", round=0
    )
    assert not decision.allowed
    assert _counted(registry, "deny") == 1.0
    [entry] = await db.audit_entries()
    assert (entry.actor, entry.verdict, entry.round, entry.region) == (
        "coordinator",
        "deny",
        0,
        None,
    )


def test_the_refusal_names_what_was_refused(policies: PolicySet) -> None:
    decision = decide_transfer(policies, _delta_to(policies, "region:us-east"))
    error = policy_denied(decision, "sending this artifact to us-east")
    assert error.message.startswith("residency policy refuses sending this artifact to us-east: ")
    assert error.body()["error"] == "policy_denied"
