"""Publishing a round: what a failed publication leads to, what a round aggregates, and
what a published round leaves behind. The back-off schedule itself is in
``test_coordinator_publication_retry.py``; publishing end to end in the integration tests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from coordinator.aggregation.outer_round import DeltaSource, PublishedRound
from coordinator.config import PublicationRetryConfig
from coordinator.intake.spool import Spool
from coordinator.publication.publisher import (
    PublicationFailed,
    delta_sources,
    discard_inputs,
    plan_retry,
    publication_details,
)
from coordinator.rounds.state import RoundConfig, RoundState
from coordinator.state.store import Receipt
from coordinator.storage.artifacts import StoredArtifact
from coordinator.storage.checkpoints import EntryKind
from coordinator.storage.working_state import WorkingState
from geofed.blobstore import FsBlobStore

T0 = 1_700_000_000.0  # 2023-11-14T22:13:20+00:00
RETRY = PublicationRetryConfig(initial_s=5, max_s=300, max_attempts=3)


def test_a_failure_names_its_cause() -> None:
    cause = OSError(28, "No space left on device")
    failure = PublicationFailed(cause)
    assert str(failure) == "OSError: [Errno 28] No space left on device"
    assert failure.cause is cause


def test_a_failed_publication_is_tried_again_after_the_back_off() -> None:
    plan = plan_retry(4, 2, "OSError: disk full", RETRY, T0)
    assert not plan.exhausted
    assert (plan.delay_s, plan.retry_at) == (10, T0 + 10)
    assert plan.retry_time == "2023-11-14T22:13:30+00:00"
    assert plan.waiting == (
        "publication of round 4 failed (attempt 2 of 3): OSError: disk full; retrying at "
        "2023-11-14T22:13:30+00:00 (in 10 s)"
    )
    assert plan.audit_details() == {
        "reason": "OSError: disk full",
        "publication_failures": 2,
        "max_attempts": 3,
        "retry_in_s": 10,
        "retry_at": "2023-11-14T22:13:30.000000Z",
    }


def test_the_last_allowed_failure_fails_the_job() -> None:
    plan = plan_retry(4, 3, "OSError: disk full", RETRY, T0)
    assert plan.exhausted
    details = plan.audit_details()
    assert (details["retry_in_s"], details["retry_at"]) == (None, None)
    assert details["publication_failures"] == 3
    assert plan.given_up("eu-store", Path("/srv/ckpt"), Path("/var/lib/geofed")) == (
        "round 4 could not be published: all 3 attempt(s) allowed by "
        "publication_retry.max_attempts failed; last: OSError: disk full. Free space (or fix "
        "permissions) in the checkpoint location eu-store (/srv/ckpt) and the state directory "
        "(/var/lib/geofed), then submit the job again; its checkpoints up to round 4 remain. "
        "To ride out longer outages, raise publication_retry in the coordinator config."
    )


def _receipt(region: str, tokens: int, blob: str) -> Receipt:
    return Receipt("llm", 4, region, "ab" * 32, blob, 10, tokens, T0)


def test_a_round_aggregates_the_deltas_of_its_included_regions() -> None:
    receipts = [
        _receipt("us-east", 30, "01" * 32),
        _receipt("ap-south", 10, "02" * 32),  # accepted, but a straggler of a closing tick
        _receipt("eu-west", 20, "03" * 32),
    ]
    assert delta_sources(receipts, ("eu-west", "us-east")) == [
        DeltaSource("us-east", 30, "01" * 32),
        DeltaSource("eu-west", 20, "03" * 32),
    ]


def test_the_publication_audit_details() -> None:
    config = RoundConfig(
        round=4,
        participants=("ap-south", "eu-west", "us-east"),
        min_regions=2,
        opened_at=T0,
        deadline_s=60,
    )
    rs = RoundState.open(config)
    rs.on_delta("us-east", 4, T0 + 1)
    rs.on_delta("eu-west", 4, T0 + 2)
    rs.tick(T0 + 60)
    params = {"w": torch.zeros(2)}
    state = WorkingState(5, params, "cd" * 32, {}, None)
    update = StoredArtifact(EntryKind.UPDATE, 4, "11" * 32, "22" * 32, 100)
    published = PublishedRound(
        4, state, {}, update, None, 50, 8, (), ("us-east", "eu-west"), "folded on arrival"
    )
    assert publication_details(published, rs, "eu-store") == {
        "update": "11" * 32,
        "update_manifest": "22" * 32,
        "snapshot": None,
        "params_hash": "cd" * 32,
        "included": ["eu-west", "us-east"],
        "stragglers": ["ap-south"],
        "tokens": 50,
        "location": "eu-store",
        "order": ["us-east", "eu-west"],
        "summation": "folded on arrival",
        "update_size": 100,
    }
    snapshot = StoredArtifact(EntryKind.SNAPSHOT, 5, "33" * 32, "44" * 32, 700)
    with_snapshot = dataclasses.replace(published, snapshot=snapshot)
    details = publication_details(with_snapshot, rs, "eu-store")
    assert (details["snapshot"], details["snapshot_size"]) == ("33" * 32, 700)


def test_a_published_round_leaves_no_inputs_behind(tmp_path: Path) -> None:
    spool_dir, deltas = tmp_path / "spool", FsBlobStore(tmp_path / "deltas")
    spool = Spool(spool_dir)
    spool.save_manifest("llm", 4, "eu-west", "ab" * 32, b"manifest")
    kept = deltas.put(b"another round's delta")
    used = deltas.put(b"a delta of round 4")
    discard_inputs(spool_dir, deltas, "llm", 4, [used])
    assert spool.load_manifest("llm", 4, "eu-west", "ab" * 32) is None
    assert not deltas.exists(used)
    assert deltas.exists(kept)


def test_inputs_that_cannot_be_discarded_are_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Stuck(FsBlobStore):
        def delete(self, digest: str) -> bool:
            raise PermissionError(13, "Permission denied")

    deltas = Stuck(tmp_path / "deltas")
    used = deltas.put(b"a delta")
    discard_inputs(tmp_path / "spool", deltas, "llm", 4, [used])
    assert deltas.exists(used)
    assert "job llm round 4: cannot discard its spooled deltas" in caplog.text
