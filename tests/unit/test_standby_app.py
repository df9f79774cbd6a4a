"""What a standby coordinator answers, shaped from the state store's facts alone."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.api.standby import (
    DAMAGED,
    StoredJob,
    job_view,
    may_see,
    readiness,
    refusal,
    unavailable_view,
)
from coordinator.jobs.spec import parse_job_spec
from coordinator.metrics import STANDBY_CATALOGUE, CoordinatorMetrics, StandbyMetrics
from coordinator.rounds.quarantine import Quarantine, QuarantineConfig
from coordinator.rounds.records import RoundRecord
from coordinator.rounds.state import RoundConfig, RoundState
from coordinator.state.store import JobRecord, StoredRound
from geofed.types import Identity
from tests.support.coordinator import job_yaml

T0 = 1_700_000_000.0
LEADER = "spiffe://acme/coordinator/main@host-a:4242"


def facts(
    *, state: str = "running", pointers: dict[str, str] | None = None, current: bool = True
) -> StoredJob:
    spec = parse_job_spec(job_yaml(rounds=5), "job.yaml").to_json()
    record = JobRecord("tiny", spec, state, T0, T0 + 9)
    stored = None
    if current:
        config = RoundConfig(
            round=2, participants=("eu-west", "us-east"), min_regions=2, opened_at=T0, deadline_s=30
        )
        state_ = RoundState.open(config)
        state_.on_delta("us-east", 2, T0 + 1)
        record_ = RoundRecord(state_, 1, 0, "initial deadline 30 s", Quarantine())
        stored = StoredRound("tiny", 2, record_.to_dict(), T0 + 1)
    found = {
        "version": "2",
        "params_hash": "ab" * 32,
        "checkpoint_location": "us-ckpt",
        "val_loss": "1:2.5",
        "val_loss_history": '{"1": 2.5}',
    }
    return StoredJob(record, found if pointers is None else pointers, stored)


def view(job: StoredJob, *, with_spec: bool = True) -> dict[str, Any]:
    return job_view(job, QuarantineConfig(), T0 + 2, with_spec=with_spec)


def test_a_job_shows_what_the_store_knows_marked_as_served_by_a_standby() -> None:
    body = view(facts())
    assert body["served_by"] == "standby"
    assert (body["job"], body["state"], body["round"], body["rounds"]) == ("tiny", "running", 2, 5)
    assert body["params_hash"] == "ab" * 32
    assert body["checkpoint_location"] == "us-ckpt"
    assert body["global_val_loss"] == {"round": 1, "value": 2.5}
    assert body["val_loss_history"] == [{"round": 1, "value": 2.5}]
    current = body["current"]
    assert (current["round"], current["phase"], current["attempt"]) == (2, "collecting", 1)
    assert current["delivered"] == ["us-east"]
    assert body["spec"]["job"] == "tiny"
    assert body["error"] is None  # the leader's last error lives only in its memory
    assert "spec" not in view(facts(), with_spec=False)


def test_a_job_before_its_first_round_has_no_current_round() -> None:
    body = view(facts(state="queued", pointers={}, current=False))
    assert (body["state"], body["round"], body["params_hash"]) == ("queued", 0, None)
    assert "current" not in body
    assert body["global_val_loss"] is None


@pytest.mark.parametrize(
    "damage",
    [
        {"state": "exploded"},
        {"pointers": {"version": "two"}},
        {"pointers": {"version": "2", "val_loss": "garbage"}},
    ],
)
def test_a_damaged_record_raises_what_the_handler_shows_as_unavailable(
    damage: dict[str, Any],
) -> None:
    with pytest.raises(DAMAGED):
        view(facts(**damage))
    shown = unavailable_view("tiny", "cannot show the stored job")
    assert (shown["state"], shown["served_by"]) == ("unavailable", "standby")


def test_a_damaged_stored_spec_is_damaged() -> None:
    good = facts()
    bad = StoredJob(JobRecord("tiny", {"job": "tiny"}, "running", T0, T0), {}, None)
    assert view(good)["job"] == "tiny"
    with pytest.raises(DAMAGED):
        view(bad)


def test_refusals_and_readiness_name_the_leader() -> None:
    body = refusal(LEADER, "it leads (token 3)")
    assert body["error"] == "standby"
    assert body["leader"] == LEADER
    assert LEADER in body["message"]
    assert "send it to the leader" in body["message"]
    unknown = refusal("", "cannot reach the leader lease", "and cannot read the state now")
    assert unknown["leader"] is None
    assert "not known yet" in unknown["message"]
    assert "cannot read the state now" in unknown["message"]
    ready = readiness(LEADER, "it leads (token 3)")
    assert ready == {
        "ready": False,
        "checks": {"leader_lease": "standby: it leads (token 3)"},
        "leader": LEADER,
        "served_by": "standby",
    }


@pytest.mark.parametrize(
    ("who", "sees"),
    [
        ("observer/grafana", True),
        ("operator/alice", True),
        ("region/eu-west", True),
        ("region/ap-south", False),  # not one of the job's regions: as if it did not exist
        ("coordinator/main", False),
    ],
)
def test_who_may_see_a_job_follows_the_leaders_rule(who: str, sees: bool) -> None:
    regions = {"eu-west": ["a"], "us-east": ["b"]}
    assert may_see(Identity.parse(f"spiffe://acme/{who}"), regions) is sees


def test_a_job_shows_the_regions_it_runs_on_now_as_the_leader_does() -> None:
    pointers = {"version": "2", "member.us-east": '{"slot": null, "datasets": ["d"]}'}
    body = view(facts(pointers=pointers))
    assert list(body["regions"]) == ["eu-west"]  # us-east left the job
    assert list(body["spec"]["regions"]) == ["eu-west"]
    with pytest.raises(DAMAGED):
        view(facts(pointers={"version": "2", "member.us-east": "{not json"}))


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(name, labels) -> value of every sample ``registry`` exposes."""
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_a_standby_exports_that_it_does_not_lead_and_whom_it_sees_leading() -> None:
    metrics = StandbyMetrics(CollectorRegistry())
    assert samples(metrics.registry) == {
        ("geofed_coordinator_leader", ()): 0.0,
        ("geofed_coordinator_standby_info", (("leader", ""),)): 1.0,  # not known yet
    }
    metrics.saw(LEADER)
    metrics.saw("spiffe://acme/coordinator/main@host-b:77")  # the lease changed hands
    assert samples(metrics.registry) == {  # one info series at a time: bounded
        ("geofed_coordinator_leader", ()): 0.0,
        (
            "geofed_coordinator_standby_info",
            (("leader", "spiffe://acme/coordinator/main@host-b:77"),),
        ): 1.0,
    }
    text = generate_latest(metrics.registry).decode()
    for spec in STANDBY_CATALOGUE:
        assert f"# TYPE {spec.name} gauge" in text, spec.name


def test_the_leaders_registry_says_it_leads() -> None:
    registry = CollectorRegistry()
    CoordinatorMetrics(registry)
    assert samples(registry)[("geofed_coordinator_leader", ())] == 1.0
    assert "geofed_coordinator_standby_info" not in generate_latest(registry).decode()
