"""Table-driven residency decisions over the example policies in configs/policies."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from geofed.types import ArtifactKind
from policies import (
    Admission,
    JobPlacement,
    PolicySet,
    Provenance,
    StorageLocation,
    Transfer,
    admit_job,
    decide_transfer,
    load_policies,
)

POLICY_DIR = Path(__file__).resolve().parents[2] / "configs" / "policies"

K = ArtifactKind


@pytest.fixture(scope="module")
def federation() -> PolicySet:
    return load_policies([POLICY_DIR])


# Each case: "KIND SOURCE -> DESTINATION [of PROVENANCE] [@COORDINATOR_JURISDICTION]"
# (without "of", the provenance is the source region with all its datasets), and the
# expected "allow|deny RULE_ID" of the deciding rule.
TRANSFERS = [
    ("model_delta region:eu-west -> coordinator @EU", "allow eu-west:exports.model_delta[0]"),
    ("model_delta region:ap-south -> coordinator", "allow ap-south:exports.model_delta[0]"),
    ("model_delta region:eu-west -> region:us-east", "deny eu-west:exports.model_delta[default]"),
    (
        "model_delta region:ap-south -> storage:eu-ckpt",
        "deny ap-south:exports.model_delta[default]",
    ),
    # a delta computed in us-east from EU data needs eu-west's consent too
    (
        "model_delta region:us-east -> region:ap-south of eu-west",
        "deny eu-west:exports.model_delta[default]",
    ),
    (
        "model_delta region:us-east -> coordinator of eu-west",
        "allow eu-west:exports.model_delta[0]",
    ),
    ("raw_data region:eu-west -> region:us-east", "deny eu-west:exports.raw_data[1]"),
    (
        "raw_data region:eu-west -> storage:eu-ckpt of eu-west/eu-parliament-proceedings",
        "allow eu-west:exports.raw_data[0]",
    ),
    # personal data may sit on its own region's storage...
    (
        "raw_data region:eu-west -> storage:eu-ckpt of eu-west/eu-support-chats",
        "allow eu-west:exports.raw_data[0]",
    ),
    # ...but nowhere else, even where the region-wide rule allows raw data
    (
        "raw_data region:eu-west -> coordinator of eu-west/eu-support-chats @EU",
        "deny eu-west:datasets[0].classification",
    ),
    (
        "raw_data region:eu-west -> coordinator of eu-west/eu-parliament-proceedings @EU",
        "allow eu-west:exports.raw_data[0]",
    ),
    (
        "raw_data region:us-east -> region:eu-west of us-east/us-public-domain-books",
        "allow us-east:exports.raw_data[0]",
    ),
    # a dataset-level rule is stricter than its permissive region
    (
        "raw_data region:us-east -> region:eu-west of us-east/us-product-docs",
        "deny us-east:datasets[1].exports.raw_data[1]",
    ),
    (
        "raw_data region:us-east -> storage:us-ckpt of us-east/us-product-docs",
        "allow us-east:exports.raw_data[0]",
    ),
    ("raw_data region:us-east -> region:ap-south", "deny us-east:datasets[1].exports.raw_data[1]"),
    ("raw_data region:ap-south -> region:eu-west", "deny ap-south:exports.raw_data[0]"),
    ("raw_data region:ap-south -> region:ap-south", "allow ap-south:home"),
    (
        "regional_checkpoint region:ap-south -> storage:ap-south-ckpt",
        "deny ap-south:exports.regional_checkpoint[0]",
    ),
    (
        "regional_checkpoint region:eu-west -> storage:eu-ckpt",
        "allow eu-west:exports.regional_checkpoint[0]",
    ),
    (
        "regional_checkpoint region:eu-west -> storage:us-ckpt",
        "deny eu-west:exports.regional_checkpoint[1]",
    ),
    # inheritance: a global checkpoint is as restricted as all its contributors together
    (
        "global_checkpoint coordinator -> storage:us-ckpt of us-east",
        "allow us-east:exports.global_checkpoint[0]",
    ),
    (
        "global_checkpoint coordinator -> storage:us-ckpt of us-east,eu-west",
        "deny eu-west:exports.global_checkpoint[1]",
    ),
    (
        "global_checkpoint coordinator -> storage:us-ckpt of ap-south",
        "deny ap-south:exports.global_checkpoint[1]",
    ),
    (
        "global_checkpoint coordinator -> storage:eu-ckpt of us-east,eu-west,ap-south",
        "allow ap-south:exports.global_checkpoint[0]",
    ),
    (
        "global_checkpoint coordinator -> storage:ap-south-ckpt of ap-south,us-east",
        "allow ap-south:exports.global_checkpoint[0]",
    ),
    (
        "global_checkpoint coordinator -> storage:ap-south-ckpt of ap-south,eu-west",
        "deny eu-west:exports.global_checkpoint[1]",
    ),
    # the source's policy applies too: a US-only model leaving EU storage needs eu-west's consent
    (
        "global_checkpoint storage:eu-ckpt -> storage:us-ckpt of us-east",
        "deny eu-west:exports.global_checkpoint[1]",
    ),
    (
        "global_update coordinator -> region:eu-west of us-east,eu-west,ap-south",
        "allow ap-south:exports.global_update[0]",
    ),
    (
        "global_update coordinator -> region:us-east of eu-west",
        "allow eu-west:exports.global_update[0]",
    ),
    ("metrics region:eu-west -> coordinator", "allow eu-west:exports.metrics[0]"),
    ("metrics region:eu-west -> region:us-east", "deny eu-west:exports.metrics[default]"),
    (
        "logs region:eu-west -> coordinator of eu-west/eu-parliament-proceedings @EU",
        "allow eu-west:exports.logs[0]",
    ),
    # jurisdiction rules cannot match a coordinator of unknown jurisdiction
    (
        "logs region:eu-west -> coordinator of eu-west/eu-parliament-proceedings",
        "deny eu-west:exports.logs[default]",
    ),
    (
        "logs region:eu-west -> coordinator of eu-west/eu-support-chats @EU",
        "deny eu-west:datasets[0].exports.logs[0]",
    ),
    ("logs region:ap-south -> coordinator @IN", "allow ap-south:exports.logs[0]"),
    ("logs region:ap-south -> coordinator @US", "deny ap-south:exports.logs[default]"),
    ("metrics coordinator -> region:ap-south of mars", "deny mars:no-policy"),
    ("metrics region:eu-west -> coordinator of eu-west/no-such-set", "deny eu-west:datasets"),
    ("metrics region:eu-west -> coordinator of eu-west/us-product-docs", "deny eu-west:datasets"),
]


def _transfer(policies: PolicySet, case: str) -> Transfer:
    kind, source, arrow, destination, *rest = case.split()
    assert arrow == "->"
    coordinator = next((word[1:] for word in rest if word.startswith("@")), None)
    src = policies.endpoint(source, coordinator)
    dst = policies.endpoint(destination, coordinator)
    if "of" in rest:
        provenance = Provenance.parse(rest[rest.index("of") + 1])
    else:
        provenance = Provenance.regions(src.name)
    return Transfer(ArtifactKind(kind), src, dst, provenance)


@pytest.mark.parametrize(("case", "expected"), TRANSFERS)
def test_transfer_decision(federation: PolicySet, case: str, expected: str) -> None:
    verb, rule_id = expected.split()
    transfer = _transfer(federation, case)
    decision = decide_transfer(federation, transfer)
    assert (decision.verb, decision.rule.rule_id) == (verb, rule_id), decision
    assert decision.subject.startswith(f"{transfer.kind} from {transfer.source} to ")
    if not decision.allowed:
        assert decision.reason == next(v.reason for v in decision.verdicts if not v.allowed)
    if rule_id.endswith("[default]"):
        assert "default is deny" in decision.reason


def test_rule_origins_point_at_the_rule_lines(federation: PolicySet) -> None:
    checked = 0
    for case, _ in TRANSFERS:
        for verdict in decide_transfer(federation, _transfer(federation, case)).verdicts:
            if verdict.rule.origin == "-":
                continue
            file, line = verdict.rule.origin.rsplit(":", 1)
            text = Path(file).read_text(encoding="utf-8").splitlines()[int(line) - 1].strip()
            rid = verdict.rule.rule_id
            if rid.endswith("]") and not rid.endswith("[default]"):
                assert text.startswith("- effect:"), (rid, text)
            elif rid.endswith("[default]"):
                assert text == f"{rid.split('.')[-1].removesuffix('[default]')}:", (rid, text)
            elif rid.endswith(".classification"):
                assert text.startswith("classification:"), (rid, text)
            elif rid.endswith(":home"):
                assert text.startswith("region:"), (rid, text)
            checked += 1
    assert checked > len(TRANSFERS)


def test_default_deny_names_the_missing_kind(tmp_path: Path) -> None:
    (tmp_path / "r.yaml").write_text(
        "region: solo\njurisdiction: EU\nexports:\n  metrics:\n"
        "    - {effect: allow, to: [coordinator]}\n",
        encoding="utf-8",
    )
    policies = load_policies([tmp_path])
    transfer = Transfer(
        K.LOGS,
        policies.endpoint("region:solo"),
        policies.endpoint("coordinator"),
        Provenance.regions("solo"),
    )
    decision = decide_transfer(policies, transfer)
    assert not decision.allowed
    assert decision.rule.rule_id == "solo:exports.logs[default]"
    assert decision.reason == "solo has no rules for logs; default is deny"
    assert decision.rule.origin == f"{tmp_path / 'r.yaml'}:3"


def test_nothing_to_consult_is_denied(federation: PolicySet) -> None:
    transfer = Transfer(
        K.METRICS,
        federation.endpoint("coordinator"),
        federation.endpoint("region:us-east"),
        Provenance.of({}),
    )
    decision = decide_transfer(federation, transfer)
    assert not decision.allowed
    assert decision.rule.rule_id == "federation:default-deny"
    assert "default is deny" in decision.reason


def test_decision_as_dict_lists_every_verdict(federation: PolicySet) -> None:
    transfer = Transfer(
        K.GLOBAL_CHECKPOINT,
        federation.endpoint("coordinator"),
        federation.endpoint("storage:us-ckpt"),
        Provenance.parse("eu-west,us-east"),
    )
    record = decide_transfer(federation, transfer).as_dict()
    assert record["allowed"] is False
    assert record["rule"] == "eu-west:exports.global_checkpoint[1]"
    assert str(record["origin"]).endswith("eu-west.yaml:77")
    verdicts = record["verdicts"]
    assert isinstance(verdicts, list)
    assert [(v["rule"], v["allowed"]) for v in verdicts] == [
        ("eu-west:exports.global_checkpoint[1]", False),
        ("us-east:exports.global_checkpoint[0]", True),
    ]


# --- admission ---------------------------------------------------------------------------

ALL_THREE = {
    "eu-west": ["eu-support-chats", "eu-parliament-proceedings"],
    "us-east": ["us-public-domain-books", "us-product-docs"],
    "ap-south": ["in-news-articles", "in-indic-wikipedia"],
}
EU_CKPT = StorageLocation("eu-ckpt", "EU", "eu-west")
US_CKPT = StorageLocation("us-ckpt", "US", "us-east")
IN_CKPT = StorageLocation("ap-south-ckpt", "IN", "ap-south")

# (regions, checkpoint candidates, admitted, allowed storage, rule ids among the denials)
ADMISSIONS = [
    pytest.param(ALL_THREE, [EU_CKPT], True, ["eu-ckpt"], set(), id="three-regions-eu-storage"),
    pytest.param(
        ALL_THREE,
        [US_CKPT],
        False,
        [],
        {
            "eu-west:exports.global_checkpoint[1]",
            "ap-south:exports.global_checkpoint[1]",
            "job:checkpoint_storage",
        },
        id="three-regions-us-storage-only",
    ),
    pytest.param(
        ALL_THREE,
        [US_CKPT, IN_CKPT, EU_CKPT],
        True,
        ["eu-ckpt"],
        set(),
        id="storage-filtered-to-eu",
    ),
    pytest.param(
        {"us-east": ["us-public-domain-books"], "ap-south": ["in-indic-wikipedia"]},
        [US_CKPT, IN_CKPT],
        True,
        ["ap-south-ckpt"],
        set(),
        id="in-storage-without-eu-data",
    ),
    pytest.param(
        {"us-east": ["us-product-docs"]}, [US_CKPT], True, ["us-ckpt"], set(), id="us-only"
    ),
    pytest.param(
        {"us-east": ["eu-support-chats"]},
        [EU_CKPT],
        False,
        ["eu-ckpt"],
        {"eu-west:datasets[0].processed_in", "eu-west:exports.raw_data[1]"},
        id="eu-personal-data-in-us",
    ),
    pytest.param(
        {"us-east": ["eu-parliament-proceedings"]},
        [EU_CKPT],
        False,
        ["eu-ckpt"],
        {"eu-west:datasets[1].processed_in", "eu-west:exports.raw_data[1]"},
        id="eu-public-data-in-us",
    ),
    pytest.param(
        {"eu-west": ["us-public-domain-books"]},
        [EU_CKPT],
        True,
        ["eu-ckpt"],
        set(),
        id="us-public-data-in-eu",
    ),
    pytest.param(
        {"eu-west": ["us-product-docs"]},
        [EU_CKPT],
        False,
        ["eu-ckpt"],
        {"us-east:datasets[1].processed_in", "us-east:datasets[1].exports.raw_data[1]"},
        id="us-internal-data-in-eu",
    ),
    pytest.param(
        {"mars": ["us-public-domain-books"]},
        [US_CKPT],
        False,
        [],
        {"mars:no-policy"},
        id="region-without-policy",
    ),
    pytest.param(
        {"eu-west": ["eu-cat-pictures"]},
        [EU_CKPT],
        False,
        ["eu-ckpt"],
        {"eu-west:datasets"},
        id="unknown-dataset",
    ),
    pytest.param(
        {"eu-west": ["eu-support-chats"]},
        [],
        False,
        [],
        {"job:checkpoint_storage"},
        id="no-storage-candidates",
    ),
    pytest.param(
        {"eu-west": ["eu-support-chats"]},
        [StorageLocation("eu-ckpt", "US")],
        False,
        [],
        {"eu-west:storage[0]", "job:checkpoint_storage"},
        id="storage-misdeclared",
    ),
    pytest.param(
        {"eu-west": ["eu-support-chats"]},
        [StorageLocation("eu-scratch", "EU")],
        True,
        ["eu-scratch"],
        set(),
        id="undeclared-eu-storage",
    ),
]


@pytest.mark.parametrize(("regions", "storage", "admitted", "allowed", "denied_by"), ADMISSIONS)
def test_admission(
    federation: PolicySet,
    regions: dict[str, list[str]],
    storage: list[StorageLocation],
    admitted: bool,
    allowed: list[str],
    denied_by: set[str],
) -> None:
    admission = admit_job(federation, JobPlacement.build(regions, "EU", storage))
    assert admission.admitted is admitted, _denials(admission)
    assert [s.name for s in admission.checkpoint_storage] == allowed
    rules = {v.rule.rule_id for d in admission.denials for v in d.verdicts if not v.allowed}
    assert denied_by <= rules, rules
    assert all(not d.allowed for d in admission.denials)
    assert set(admission.denials) <= set(admission.decisions)


def test_admission_checks_every_flow_of_the_demo_job(federation: PolicySet) -> None:
    admission = admit_job(federation, JobPlacement.build(ALL_THREE, "EU", [EU_CKPT]))
    subjects = [d.subject for d in admission.decisions]
    for region in ALL_THREE:
        assert any(
            s.startswith(f"model_delta from region:{region} to coordinator") for s in subjects
        )
        assert any(s.startswith(f"metrics from region:{region} to coordinator") for s in subjects)
        assert any(
            s.startswith(f"global_update from coordinator to region:{region}") for s in subjects
        )
    assert sum(s.startswith("processing of dataset") for s in subjects) == 6
    assert any(
        s.startswith("global_checkpoint from coordinator to storage:eu-ckpt") for s in subjects
    )


def test_admission_reports_every_denial_not_only_the_first(federation: PolicySet) -> None:
    regions = {"us-east": ["eu-support-chats", "in-news-articles"]}
    admission = admit_job(federation, JobPlacement.build(regions, "EU", [US_CKPT]))
    assert not admission.admitted
    rules = {v.rule.rule_id for d in admission.denials for v in d.verdicts if not v.allowed}
    assert {
        "eu-west:datasets[0].processed_in",
        "eu-west:datasets[0].classification",
        "ap-south:datasets[0].processed_in",
        "ap-south:datasets[0].classification",
        "ap-south:exports.raw_data[0]",
        "eu-west:exports.global_checkpoint[1]",
        "ap-south:exports.global_checkpoint[1]",
        "job:checkpoint_storage",
    } <= rules


def _denials(admission: Admission) -> list[str]:
    return [str(d) for d in admission.denials]


REGIONS = ["eu-west", "us-east", "ap-south"]
ENDPOINTS = [
    "coordinator",
    "region:eu-west",
    "region:us-east",
    "region:ap-south",
    "storage:eu-ckpt",
    "storage:us-ckpt",
    "storage:ap-south-ckpt",
]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(list(ArtifactKind)),
    source=st.sampled_from(ENDPOINTS),
    destination=st.sampled_from(ENDPOINTS),
    coordinator=st.sampled_from([None, "EU", "US", "IN"]),
    smaller=st.sets(st.sampled_from(REGIONS), min_size=1),
    extra=st.sets(st.sampled_from(REGIONS)),
)
def test_more_contributors_never_loosen_a_decision(
    federation: PolicySet,
    kind: ArtifactKind,
    source: str,
    destination: str,
    coordinator: str | None,
    smaller: set[str],
    extra: set[str],
) -> None:
    src = federation.endpoint(source, coordinator)
    dst = federation.endpoint(destination, coordinator)

    def allowed(regions: set[str]) -> bool:
        transfer = Transfer(kind, src, dst, Provenance.regions(*regions))
        return decide_transfer(federation, transfer).allowed

    if allowed(smaller | extra):
        assert allowed(smaller)


def test_a_region_without_a_policy_is_named_first_not_its_datasets(federation: PolicySet) -> None:
    regions = {"mars": ["us-public-domain-books", "eu-cat-pictures"]}
    admission = admit_job(federation, JobPlacement.build(regions, "EU", [US_CKPT]))
    assert not admission.admitted
    first = admission.denials[0]
    assert first.subject == "training in region mars"
    assert [v.reason for v in first.verdicts] == [
        "no policy is loaded for region mars; default is deny"
    ]
    assert not [d for d in admission.decisions if d.subject.startswith("processing of dataset")]


def test_initial_parameters_bring_the_provenance_of_what_they_derive_from(
    federation: PolicySet,
) -> None:
    us_only = {"us-east": ["us-public-domain-books"]}
    assert admit_job(federation, JobPlacement.build(us_only, "EU", [US_CKPT])).admitted
    # θ_0 from a job trained on EU chats: its checkpoints may not go to US storage.
    inherited = {"eu-west": ["eu-support-chats"]}
    admission = admit_job(
        federation, JobPlacement.build(us_only, "EU", [US_CKPT], inherited=inherited)
    )
    assert not admission.admitted
    rules = {v.rule.rule_id for d in admission.denials for v in d.verdicts if not v.allowed}
    assert "eu-west:exports.global_checkpoint[1]" in rules
    with_eu_storage = JobPlacement.build(us_only, "EU", [EU_CKPT, US_CKPT], inherited=inherited)
    assert [s.name for s in admit_job(federation, with_eu_storage).checkpoint_storage] == [
        "eu-ckpt"
    ]
