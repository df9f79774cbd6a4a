"""Lineage: code fingerprints, the mismatch check, and a round's record from its deltas."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import geofed
from coordinator.publication.lineage import (
    ContributionLog,
    code_mismatch_at_first_delta,
    round_record,
)
from coordinator.state.store import Receipt
from geofed.lineage import (
    Software,
    TaskCode,
    code_fingerprint,
    code_mismatch,
    local_software,
    spec_hash,
    task_code,
)
from tests.support.manifests import make_manifest
from tests.support.pki import make_federation
from tests.support.tiny_task import SPEC

SPEC_JSON = {
    "job": "tiny-lm",
    "task": {"spec": SPEC, "options": {}},
    "codec": {"scheme": "int8"},
    "training": {"precision": "fp32"},
    "outer_optimizer": {"lr": 0.7},
    "aggregation": {"rule": "mean"},
    "inner_steps": 5,
    "seed": 0,
}


def test_the_fingerprint_covers_every_file_and_its_name(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    files = [tmp_path / "a.py", tmp_path / "b.py"]
    first = code_fingerprint(tmp_path, files)
    assert code_fingerprint(tmp_path, list(reversed(files))) == first
    (tmp_path / "b.py").write_text("y = 3\n")
    assert code_fingerprint(tmp_path, files) != first
    (tmp_path / "b.py").write_text("y = 2\n")
    (tmp_path / "b.py").rename(tmp_path / "c.py")
    assert code_fingerprint(tmp_path, [tmp_path / "a.py", tmp_path / "c.py"]) != first


def test_local_software_names_this_process() -> None:
    software = local_software(SPEC)
    assert software.torch == torch.__version__
    assert software.geofed == geofed.__version__
    assert software.task.spec == SPEC
    assert software.task.package == "tests"
    assert software.task == task_code(SPEC)
    charlm = task_code("geofed.examples.charlm:CharLMTask")
    assert charlm.package == "geofed"
    assert charlm.version == geofed.__version__
    assert charlm.fingerprint != software.task.fingerprint


def test_a_different_fingerprint_is_a_mismatch_and_says_so() -> None:
    ours = task_code(SPEC)
    same = local_software(SPEC)
    assert code_mismatch("eu-west", same, ours) is None
    other = same.model_copy(update={"task": ours.model_copy(update={"fingerprint": "0" * 64})})
    reason = code_mismatch("eu-west", other, ours)
    assert reason is not None
    assert "eu-west" in reason
    assert "0000000000000000" in reason
    assert "no software" in (code_mismatch("us-east", None, ours) or "")


def test_the_spec_hash_ignores_key_order() -> None:
    assert spec_hash({"a": 1, "b": [1, 2]}) == spec_hash({"b": [1, 2], "a": 1})
    assert spec_hash({"a": 1}) != spec_hash({"a": 2})


def receipt(region: str, digest: str, tokens: int) -> Receipt:
    return Receipt("tiny-lm", 7, region, digest, "cd" * 32, 10, tokens, 0.0)


def test_a_round_record_names_each_delta_and_what_trained_it(tmp_path: Path) -> None:
    producer = make_federation(tmp_path / "pki").issue("region", "eu-west")
    log = ContributionLog(tmp_path / "lineage")
    ours = local_software(SPEC)
    manifest = make_manifest(producer, software=ours)
    log.record("tiny-lm", "eu-west", "11" * 32, manifest)
    stale = make_manifest(producer, software=ours, round=7)
    log.record("tiny-lm", "us-east", "22" * 32, stale)
    record = round_record(
        log,
        job="tiny-lm",
        round_=7,
        spec=SPEC_JSON,
        receipts=[receipt("eu-west", "11" * 32, 4096), receipt("us-east", "33" * 32, 100)],
        included=["us-east", "eu-west"],
    )
    assert record["round"] == 7
    assert record["version"] == 8
    assert record["spec_hash"] == spec_hash(SPEC_JSON)
    assert record["codec"] == {"scheme": "int8"}
    assert record["outer_optimizer"] == {"lr": 0.7}
    assert record["coordinator"] == ours.model_dump(mode="json")
    contributors = record["contributors"]
    assert isinstance(contributors, list)
    eu, us = (c for c in contributors if isinstance(c, dict))
    assert eu == {
        "region": "eu-west",
        "jurisdiction": "EU",
        "datasets": ["c4-eu"],
        "delta_manifest": "11" * 32,
        "tokens": 4096,
        "software": ours.model_dump(mode="json"),
        "code_matches": True,
        # What the region says of its data: a fingerprint, never a path.
        "data_fingerprints": {"c4-eu": "5e" * 32},
    }
    # us-east's logged entry is of another delta than the accepted one: no software.
    assert us["region"] == "us-east"
    assert us["delta_manifest"] == "33" * 32
    assert us["software"] is None
    assert us["code_matches"] is False
    log.discard_round("tiny-lm", 7)
    assert log.load("tiny-lm", 7, "eu-west") is None


def test_software_refuses_what_is_not_a_version() -> None:
    code = TaskCode(spec=SPEC, package="tests", version=None, fingerprint="ab" * 32)
    with pytest.raises(ValueError, match="torch"):
        Software(torch="2.13 with spaces", geofed="0.1.0", python="3.11", task=code)


def test_a_region_with_other_code_is_flagged_at_its_first_delta_only(tmp_path: Path) -> None:
    producer = make_federation(tmp_path / "pki").issue("region", "eu-west")
    ours = local_software(SPEC)
    other = ours.model_copy(
        update={"task": ours.task.model_copy(update={"fingerprint": "ab" * 32})}
    )
    same = make_manifest(producer, software=ours)
    assert code_mismatch_at_first_delta("job-flag", "eu-west", SPEC, same) is None
    differs = make_manifest(producer, software=other)
    reason = code_mismatch_at_first_delta("job-flag", "eu-west", SPEC, differs)
    assert reason is not None
    assert "abababababababab" in reason
    assert code_mismatch_at_first_delta("job-flag", "eu-west", SPEC, differs) is None
    assert code_mismatch_at_first_delta("job-other", "eu-west", SPEC, differs) is not None
