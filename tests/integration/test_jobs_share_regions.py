"""Two jobs sharing two regions, with the real daemons: every region keeps each job's
regional state apart (no job starts afresh after its first round), and once a job is done
its regional checkpoint is removed from the region's hand-off directory. The coordinator
keeps each job's working state apart too: the two jobs train alike, so their blobs are the
same bytes, and neither job's deletions take the other's. ``geofed usage`` then reports
what each job sent and stored, priced, as computed by hand from the receipts and the
checkpoint chains."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
import re
import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from coordinator.costs.showback import GB, MONTH_S
from coordinator.state.sqlite import DB_FILENAME
from coordinator.storage.checkpoints import CheckpointStore
from coordinator.storage.job_blobs import JobBlobStores
from coordinator.storage.working_state import ParamsStore
from regional_agent.handoff.directory import HandoffDir
from tests.support.federation import FederationRun, operator_cli, running_federation

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REGIONS = ("eu-west", "us-east")
JOBS = ("alpha", "beta")
ROUNDS = 3
#: A GB sent from each region to the coordinator, and from the coordinator to each.
UPLOAD_PER_GB = {"eu-west": 0.09, "us-east": 0.12}
DOWNLOAD_PER_GB = 0.05
STORAGE_PER_GB_MONTH = 0.02
#: alpha's budget: below what its WAN and storage cost.
BUDGET = 1e-9


def priced(name: str, config: dict[str, Any]) -> None:
    if name == "coordinator":
        config["prices"] = {
            "currency": "EUR",
            "regions": {
                "eu-west": {"egress_per_gb": {"coordinator": UPLOAD_PER_GB["eu-west"]}},
                "us-east": {"egress_per_gb": {"default": UPLOAD_PER_GB["us-east"]}},
            },
            "coordinator": {"egress_per_gb": {"default": DOWNLOAD_PER_GB}},
            "storage": {
                entry["name"]: {"per_gb_month": STORAGE_PER_GB_MONTH} for entry in config["storage"]
            },
        }


def handoff(fed: FederationRun, region: str) -> HandoffDir:
    return HandoffDir(fed.work / "agents" / region / "workers")


async def wait_gone(fed: FederationRun, paths: list[Path], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(p.exists() for p in paths):
        fed.children.check_alive()
        if time.monotonic() > deadline:
            left = [str(p) for p in paths if p.exists()]
            raise AssertionError(f"still on disk after {timeout_s} s: {left}\n{fed.log_tails()}")
        await asyncio.sleep(0.3)


async def test_jobs_sharing_regions_keep_their_own_regional_state(tmp_path: Path) -> None:
    async with running_federation(
        tmp_path, regions=REGIONS, rounds=ROUNDS, inner_steps=3, customize=priced
    ) as fed:
        spec = fed.job_spec()
        for job in JOBS:
            budget = {"budget": BUDGET} if job == "alpha" else {}
            status, body = await fed.submit({**spec, "job": job, **budget})
            assert status == 201, body
            # No GPUs stated: nothing to price before a round is measured.
            assert body["cost_estimate"] == {
                "currency": "EUR",
                "amount": None,
                "reason": "the job states no GPUs: no GPU time to estimate",
                "budget": None
                if job == "beta"
                else {
                    "amount": BUDGET,
                    "expected": None,
                    "within": None,
                    "basis": "the job states no GPUs: no GPU time to estimate",
                },
            }, body
        queue = await fed.get("/v1/queue")
        assert {
            r["job"]: (r["cost_estimate"]["budget"] or {}).get("amount") for r in queue["jobs"]
        } == {
            "alpha": BUDGET,
            "beta": None,
        }
        for job in JOBS:
            await fed.wait_for(
                lambda s: s.get("state") == "completed",
                timeout_s=300,
                what=f"job {job} to complete",
                job=job,
            )
        for region in REGIONS:
            log = handoff(fed, region).rank_log_path(0).read_text()
            for job in JOBS:
                # Each job's first round starts afresh, every later one resumes its own state.
                assert log.count(f"job {job}: fresh regional state") == 1, (region, job)
                assert f"job {job} round {ROUNDS - 1}:" in log, (region, job)
        # Done: the regions drop the jobs' regional checkpoints (disk stays bounded).
        await wait_gone(
            fed, [handoff(fed, r).checkpoint_path(job) for r in REGIONS for job in JOBS]
        )
        state_dir = fed.work / "coordinator"
        stores = JobBlobStores(state_dir)
        for job in JOBS:
            database = f"file:{state_dir / DB_FILENAME}?mode=ro"
            with contextlib.closing(sqlite3.connect(database, uri=True)) as db:
                rows = db.execute(
                    "SELECT name, value FROM pointers WHERE job_id = ?", (job,)
                ).fetchall()
            state = ParamsStore(stores.for_job(job)).load(dict(rows))
            assert state.version == ROUNDS, (job, state.version)
        assert stores.legacy_count() == 0
        await usage_is_priced_as_computed_by_hand(fed, state_dir)


async def usage_is_priced_as_computed_by_hand(fed: FederationRun, state_dir: Path) -> None:
    until = time.time()
    result = await operator_cli(
        fed, "usage", "--csv", "--since", "1h",
        "--until", datetime.fromtimestamp(until, UTC).isoformat(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    jobs = {row["job"]: row for row in rows if row["scope"] == "job"}
    assert sorted(jobs) == sorted(JOBS)
    database = f"file:{state_dir / DB_FILENAME}?mode=ro"
    totals = 0.0
    for job in JOBS:
        row = jobs[job]
        with contextlib.closing(sqlite3.connect(database, uri=True)) as db:
            receipts = db.execute(
                "SELECT region, size, tokens FROM receipts WHERE job_id = ?", (job,)
            ).fetchall()
            (location,) = db.execute(
                "SELECT value FROM pointers WHERE job_id = ? AND name = 'checkpoint_location'",
                (job,),
            ).fetchone()
            fetched = db.execute(
                "SELECT round, details FROM audit_log WHERE job = ? AND verdict = 'allow' AND "
                "action = 'policy.global_update' AND region IS NOT NULL",
                (job,),
            ).fetchall()
        assert len(receipts) == ROUNDS * len(REGIONS)
        chain = CheckpointStore(location, fed.work / "checkpoints" / location)
        sizes = [(e, chain.blobs.size(e.payload_digest)) for e in chain.entries(job)]
        updates = [size for e, size in sizes if e.kind.value == "update"]
        assert len(updates) == ROUNDS
        upload_cost = sum(size / GB * UPLOAD_PER_GB[region] for region, size, _ in receipts)
        # What the coordinator let each region fetch (θ_0's snapshot, then each update
        # but the last, which ends the job), as the chain stores it.
        by_entry = {(e.kind.value, e.round): size for e, size in sizes}
        sent = [by_entry[(json.loads(details)["artifact"], r)] for r, details in fetched]
        assert len(sent) >= len(REGIONS) * ROUNDS, fetched
        download_gb = sum(sent) / GB
        stored = sum(size / GB * (until - e.recorded_at) / MONTH_S for e, size in sizes)
        assert float(row["upload_gb"]) == pytest.approx(sum(r[1] for r in receipts) / GB)
        assert float(row["upload_cost"]) == pytest.approx(upload_cost)
        assert float(row["download_gb"]) == pytest.approx(download_gb)
        assert float(row["download_cost"]) == pytest.approx(download_gb * DOWNLOAD_PER_GB)
        # The report dates each checkpoint by its audit entry, a moment after the chain.
        assert float(row["storage_gb_months"]) == pytest.approx(stored, rel=0.05)
        assert float(row["storage_cost"]) == pytest.approx(
            float(row["storage_gb_months"]) * STORAGE_PER_GB_MONTH
        )
        assert int(row["tokens"]) == sum(r[2] for r in receipts)
        assert (int(row["rounds"]), float(row["gpu_hours"])) == (ROUNDS, 0.0)  # no GPUs stated
        assert (row["currency"], row["unpriced"]) == ("EUR", "")
        totals += float(row["total"])
        # The job's status and the status page show its cost so far: the same figures.
        status = await fed.status(job)
        assert status["cost"]["currency"] == "EUR"
        assert status["cost"]["total"] == pytest.approx(float(row["total"]), rel=0.01)
        assert status["cost"]["projected_total"] is None  # it ended: no projection
        # alpha's budget against what it cost: over it (the budget is tiny on purpose).
        budget = status["cost_estimate"]["budget"]
        if job == "alpha":
            assert budget["expected"] == pytest.approx(status["cost"]["total"])
            assert (budget["within"], budget["basis"]) == (False, "what it cost"), budget
            shown = await operator_cli(fed, "job", "status", job)
            assert re.search(
                r"budget 0.00 EUR: expected [0-9.]+, OVER \(what it cost\)", shown.stdout
            )
        else:
            assert budget is None
    async with fed.http.get(f"{fed.base}/ui?part=main") as response:
        assert response.status == 200
        page = await response.text()
    assert page.count("Cost so far: ") == len(JOBS)
    (team,) = [row for row in rows if row["scope"] == "team"]
    assert team["team"] == "default"
    assert float(team["total"]) == pytest.approx(totals)
