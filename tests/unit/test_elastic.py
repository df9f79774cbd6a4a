"""Elastic jobs: the decision on a region joining or leaving, shard slots, and their wire
and store forms (pure; no sockets)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from coordinator.api.admin import parse_region_change
from coordinator.errors import CODES, BadRequest
from coordinator.jobs.regions import MEMBER_POINTER, MembershipError, effective_spec, membership_of
from coordinator.jobs.spec import JobSpecError, parse_job_spec
from coordinator.rounds.state import RoundConfig
from coordinator.scheduling.elastic import (
    Membership,
    Refusal,
    RegionChange,
    decide_change,
    join_shortfall,
    joined_provenance,
)
from coordinator.scheduling.model import Job, Region, RegionCapacity, RegionNeed, SchedulingState
from geofed.codec_params import CodecParams
from geofed.control.messages import RoundAnnouncement, decode, encode
from geofed_cli.jobs import UsageError, region_change_body

KNOWN = frozenset({"eu-west", "us-east", "ap-south", "sa-east"})


def two_of_three() -> Membership:
    return Membership.initial({"us-east": ["books"], "eu-west": ["parl"]}, slots=3)


def test_submitted_regions_keep_their_sorted_index() -> None:
    membership = two_of_three()
    assert dict(membership.assignment) == {"eu-west": 0, "us-east": 1}
    assert membership.slots == 3
    assert membership.lowest_free_slot() == 2


def test_a_joiner_takes_the_lowest_free_slot_and_a_leaver_frees_its_own() -> None:
    grown = two_of_three().joined("ap-south", ["news"])
    assert dict(grown.assignment) == {"ap-south": 2, "eu-west": 0, "us-east": 1}
    shrunk = grown.left("eu-west")
    assert dict(shrunk.assignment) == {"ap-south": 2, "us-east": 1}  # nobody else moves
    assert shrunk.departed == ("eu-west",)
    assert shrunk.datasets["eu-west"] == ("parl",)  # its data still counts
    again = shrunk.joined("sa-east", ["docs"])
    assert again.assignment["sa-east"] == 0  # the freed slot is reused
    with pytest.raises(ValueError, match="slots are taken"):
        again.joined("eu-west", ["parl"])


CASES: list[tuple[str, RegionChange, dict[str, Any], Refusal | None, int | None]] = [
    ("join", RegionChange("add", "ap-south", ("news",)), {}, None, 2),
    (
        "duplicate add",
        RegionChange("add", "eu-west", ("parl",)),
        {},
        Refusal.ALREADY_MEMBER,
        None,
    ),
    ("unknown region", RegionChange("add", "mars-1", ("x",)), {}, Refusal.UNKNOWN_REGION, None),
    ("no datasets", RegionChange("add", "ap-south"), {}, Refusal.BAD_REQUEST, None),
    (
        "over max",
        RegionChange("add", "ap-south", ("news",)),
        {"slots": 2},
        Refusal.MAX_REGIONS,
        None,
    ),
    ("leave", RegionChange("remove", "eu-west"), {"min_regions": 1}, None, 0),
    (
        "under min",
        RegionChange("remove", "eu-west"),
        {"min_regions": 2},
        Refusal.MIN_REGIONS,
        None,
    ),
    ("not a member", RegionChange("remove", "ap-south"), {}, Refusal.NOT_MEMBER, None),
    (
        "evaluating region",
        RegionChange("remove", "us-east"),
        {"min_regions": 1, "evaluation_region": "us-east"},
        Refusal.EVALUATES,
        None,
    ),
    (
        "ended job",
        RegionChange("add", "ap-south", ("n",)),
        {"ended": "completed"},
        Refusal.JOB_ENDED,
        None,
    ),
    ("unknown action", RegionChange("move", "eu-west"), {}, Refusal.BAD_REQUEST, None),
]


@pytest.mark.parametrize(
    ("name", "change", "facts", "refusal", "slot"), CASES, ids=[c[0] for c in CASES]
)
def test_decide_change(
    name: str,
    change: RegionChange,
    facts: dict[str, Any],
    refusal: Refusal | None,
    slot: int | None,
) -> None:
    slots = facts.pop("slots", 3)
    membership = Membership.initial({"us-east": ["books"], "eu-west": ["parl"]}, slots=slots)
    decision = decide_change(
        change,
        membership,
        job="j",
        min_regions=facts.pop("min_regions", 1),
        known_regions=KNOWN,
        **facts,
    )
    assert decision.refusal == refusal, decision.reason
    assert decision.allowed == (refusal is None)
    assert decision.slot == slot
    assert decision.reason  # every decision says why
    if refusal is not None:
        assert decision.status in (400, 404, 409)
        assert decision.code in CODES  # an error code the API may answer with
        assert decision.membership is None
    elif change.action == "add":
        assert decision.membership is not None
        assert decision.membership.assignment[change.region] == slot
    else:
        assert decision.membership is not None
        assert change.region not in decision.membership.assignment


def test_residency_is_asked_about_every_contributor() -> None:
    membership = two_of_three().left("eu-west")
    regions = joined_provenance(membership, "ap-south", ["news"])
    assert regions == {"ap-south": ("news",), "eu-west": ("parl",), "us-east": ("books",)}


def _holder(cpu: int) -> Job:
    return Job(
        name="other",
        team="t",
        priority="p",
        submitted_at=0.0,
        regions=("ap-south",),
        need=RegionNeed(cpu_slots=cpu),
        state=SchedulingState.RUNNING,
        placement=("ap-south",),
    )


@pytest.mark.parametrize(
    ("capacity", "up", "held", "fits"),
    [(2, True, 1, True), (2, True, 2, False), (1, False, 0, False), (0, True, 0, False)],
)
def test_a_join_needs_the_capacity_free(capacity: int, up: bool, held: int, fits: bool) -> None:
    region = Region("ap-south", RegionCapacity(cpu_slots=capacity), up=up)
    jobs = [_holder(held)] if held else []
    lack = join_shortfall(RegionNeed(cpu_slots=1), region, jobs)
    assert (lack is None) == fits, lack
    assert join_shortfall(RegionNeed(cpu_slots=1), None, []) is not None


def _announcement(**extra: Any) -> RoundAnnouncement:
    return RoundAnnouncement(
        job="j",
        round=3,
        base_round=3,
        base_hash="0" * 64,
        participants=("us-east", "ap-south"),
        min_regions=1,
        deadline=datetime.now(UTC),
        deadline_s=10.0,
        inner_steps=2,
        codec=CodecParams(),
        task="a.b:C",
        seed=0,
        state="open",
        **extra,
    )


def test_the_announcement_carries_the_assignment_and_older_ones_still_parse() -> None:
    announced = _announcement(
        regions=("ap-south", "us-east"), assignment={"us-east": 1, "ap-south": 2}, shards=3
    )
    again = decode(encode(announced), RoundAnnouncement)
    assert again.data_shard("us-east") == (1, 3)
    assert again.data_shard("ap-south") == (2, 3)
    with pytest.raises(ValueError, match="not one of"):
        again.data_shard("eu-west")
    older = json.loads(encode(announced))
    del older["assignment"], older["shards"]
    legacy = decode(json.dumps(older).encode(), RoundAnnouncement)
    assert legacy.data_shard("us-east") == (1, 2)  # its place among the regions


@pytest.mark.parametrize(
    "extra",
    [
        {"assignment": {"us-east": 1, "ap-south": 1}, "shards": 3},
        {"assignment": {"us-east": 1, "ap-south": 3}, "shards": 3},
        {"assignment": {"us-east": 1}, "shards": 3},
        {"assignment": {"us-east": 1, "ap-south": 2}},
    ],
)
def test_an_inconsistent_assignment_is_refused(extra: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        _announcement(**extra)


def test_a_round_keeps_the_shards_it_opened_with() -> None:
    config = RoundConfig(
        round=1,
        participants=("a", "b"),
        min_regions=1,
        opened_at=0.0,
        deadline_s=1.0,
        shards={"a": 0, "b": 2},
        shard_count=3,
    )
    assert RoundConfig.model_validate(config.model_dump(mode="json")) == config
    with pytest.raises(ValueError):
        RoundConfig(
            round=1,
            participants=("a", "b"),
            min_regions=1,
            opened_at=0.0,
            deadline_s=1.0,
            shards={"a": 0},
            shard_count=3,
        )


SPEC = """
job: elastic
task: {spec: "geofed.examples.charlm:CharLMTask"}
regions: {eu-west: [parl], us-east: [books]}
rounds: 2
inner_steps: 1
checkpoint_storage: [eu-ckpt]
"""


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        ("max_regions: 3\n", None),
        ("", None),
        ("max_regions: 1\n", "max_regions (1) is below the 2 regions"),
        ("min_regions: 2\nmax_regions: 2\n", None),
        ("max_regions: 0\n", "max_regions"),
        ("max_regions: many\n", "max_regions"),
    ],
)
def test_max_regions_in_the_spec(extra: str, error: str | None) -> None:
    if error is None:
        spec = parse_job_spec(SPEC + extra, "job.yaml")
        assert spec.region_slots == (3 if "3" in extra else 2)
        return
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(SPEC + extra, "job.yaml")
    assert error in str(caught.value)


def test_the_stored_membership_survives_a_restart() -> None:
    spec = parse_job_spec(SPEC + "max_regions: 3\n", "job.yaml")
    grown = Membership.initial(spec.regions, 3).joined("ap-south", ["news"]).left("eu-west")
    pointers = {
        "version": "4",
        MEMBER_POINTER + "ap-south": json.dumps({"slot": 2, "datasets": ["news"]}),
        MEMBER_POINTER + "eu-west": json.dumps({"slot": None, "datasets": ["parl"]}),
    }
    assert membership_of(spec, pointers) == grown
    assert membership_of(spec, {}) == Membership.initial(spec.regions, 3)
    with pytest.raises(MembershipError):
        membership_of(spec, {MEMBER_POINTER + "x": "nonsense"})
    running = effective_spec(spec, grown)
    assert running.region_names == ("ap-south", "us-east")
    assert (running.quorum, running.region_slots) == (2, 3)  # as submitted


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"add": "ap-south", "datasets": ["news"]}', RegionChange("add", "ap-south", ("news",))),
        (b'{"remove": "eu-west"}', RegionChange("remove", "eu-west")),
        (b"[]", None),
        (b"not json", None),
        (b'{"add": "ap-south"}', None),
        (b'{"add": "ap-south", "remove": "eu-west"}', None),
        (b'{"remove": "eu-west", "datasets": ["x"]}', None),
        (b'{"add": "Bad Name!", "datasets": ["x"]}', None),
        (b'{"add": "ap-south", "datasets": ["x", "x"]}', None),
        (b'{"add": 7, "datasets": ["x"]}', None),
        (b"{}", None),
    ],
)
def test_parse_region_change(body: bytes, expected: RegionChange | None) -> None:
    if expected is None:
        with pytest.raises(BadRequest):
            parse_region_change(body)
    else:
        assert parse_region_change(body) == expected


def test_the_cli_body() -> None:
    assert json.loads(region_change_body("ap-south", None, "a, b")) == {
        "add": "ap-south",
        "datasets": ["a", "b"],
    }
    assert json.loads(region_change_body(None, "eu-west", None)) == {"remove": "eu-west"}
    with pytest.raises(UsageError):
        region_change_body("ap-south", None, None)
    with pytest.raises(UsageError):
        region_change_body(None, "eu-west", "a")
