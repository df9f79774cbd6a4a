"""A job's retention prunes its checkpoint chain after each snapshot, audited, and what is
left still restores the job's parameters (real TLS, a real state directory)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from coordinator.storage.checkpoints import CheckpointStore
from geofed.control.broker import EmbeddedBroker
from tests.support.coordinator import (
    coordinator,
    job_yaml,
    request,
    wait_collecting,
    write_setup,
)

pytestmark = pytest.mark.integration

ROUNDS = 6  # snapshot_every 2 (the test job's): snapshots of θ_0, θ_2, θ_4 and θ_6


async def test_retention_keeps_the_newest_snapshots_and_the_archive(tmp_path: Path) -> None:
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            observer = running.session(setup.observer)
            spec = job_yaml(rounds=ROUNDS, extra="retention: {keep_snapshots: 1, keep_every: 2}\n")
            status, body = await request(operator, "POST", "/v1/jobs", data=spec)
            assert status == 201, body
            for round_ in range(ROUNDS):
                job = await wait_collecting(observer, round_)
                for seed, name in enumerate(("eu-west", "us-east"), start=1):
                    region = running.region(name)
                    manifest, stream = region.delta(
                        "tiny", round_, job["params_hash"], seed=10 * round_ + seed
                    )
                    status, body = await region.single_shot("tiny", round_, manifest, stream)
                    assert (status, body["state"]) == (200, "accepted"), body
            # The chain is pruned after the last round's commit: wait for its audit entry.
            async with asyncio.timeout(30):
                while True:
                    status, audit = await request(observer, "GET", "/v1/audit?limit=1000")
                    prunes = [e for e in audit["entries"] if e["action"] == "checkpoint.prune"]
                    if len(prunes) == 3:
                        break
                    await asyncio.sleep(0.05)
            status, job = await request(observer, "GET", "/v1/jobs/tiny")
            assert job["state"] == "completed", job

            # What is left: θ_6's snapshot, and θ_0's and θ_4's as archive points (snapshot
            # numbers 0 and 2 of keep_every 2), without the updates between them.
            store = CheckpointStore("eu-ckpt", setup.root / "ckpt" / "eu")
            left = [(e.kind.value, e.round) for e in store.entries("tiny")]
            assert left == [("snapshot", 0), ("snapshot", 4), ("snapshot", 6)], left
            # Pruned blobs are gone from the location, not just from the index.
            kept = {d for e in store.entries("tiny") for d in e.digests()}
            assert set(store.blobs.iter_digests()) == kept

            # A region resyncing now rebuilds θ_6 exactly from what is left.
            _, params_hash, version = await running.region("eu-west").download_params("tiny")
            assert (version, params_hash) == (ROUNDS, job["params_hash"])

            status, audit = await request(observer, "GET", "/v1/audit?limit=1000&verify=1")
            assert audit["verify"]["ok"], audit["verify"]
            prunes = [e for e in audit["entries"] if e["action"] == "checkpoint.prune"]
            # After θ_2's, θ_4's and θ_6's snapshots (published by rounds 1, 3 and 5).
            assert [e["round"] for e in prunes] == [1, 3, 5], prunes
            assert [e["details"]["removed"] for e in prunes] == [
                [["update", 0], ["update", 1]],
                [["snapshot", 2], ["update", 2], ["update", 3]],
                [["update", 4], ["update", 5]],
            ]
            assert "archived snapshot(s) of round(s) [0]" in prunes[0]["details"]["reason"]
