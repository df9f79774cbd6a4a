"""Jobs on the same two regions, with the real daemons (a coordinator and two agents,
embedded broker, mTLS HTTPS, each agent with one gloo worker).

Sharing: two jobs that state no needs run at once on both regions, and every region keeps
each job's regional state apart (no job starts afresh after its first round); once a job
is done its regional checkpoint is removed from the region's hand-off directory. The
coordinator keeps each job's working state apart too: the two jobs train alike, so their
blobs are the same bytes, and neither job's deletions take the other's. ``geofed usage``
then reports what each job sent and stored, priced, as computed by hand from the receipts
and the checkpoint chains.

Then, on the same federation, gang admission against the capacity the agents declare
(each region one CPU worker slot): two jobs each need one slot in both regions, so
``gang-a`` starts and ``gang-b`` is queued, and ``GET /v1/jobs/gang-b``,
``GET /v1/queue``, ``GET /v1/regions`` and ``geofed_jobs_queued`` say why and what is in
use. When ``gang-a`` completes, its slots free, ``gang-b`` is admitted (audited with the
reason) and completes. Then preemption: a ``production`` job arriving while a
``research`` job runs stops it at its next round boundary (its current round completes
and is published), runs, and the research job resumes from the round where it stopped
and completes: no round lost, failed or run twice, and both end with the parameters the
same jobs reach when each runs alone.

Last, the adaptive snapshot interval: a job with ``snapshot_every: auto`` (bounds 2..4)
has no snapshot cost measured at first: it takes its shortest interval, so θ_2 is
snapshotted and its cost measured; with no failure observed it then takes its longest
(4). eu-west's agent is killed (its process group; the broker publishes its Will) and
started again: the job's status cites the measured MTBF and the interval drops to the
minimum. The chain on disk holds exactly the snapshots the policy chose, the status said
what it planned, and the metric shows the interval.

And a job that assigns eu-west a dataset its agent does not train on (eu-support-chats;
its policy declares it, so the coordinator admits the job): eu-west refuses round 0
before anything trains, its status names the dataset, and the coordinator appends a
``round.refuse`` entry with the region as actor and the reason (once however often the
status repeats: ``tests/unit/test_region_refusals.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
import re
import sqlite3
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from coordinator.costs.showback import GB, MONTH_S
from coordinator.state.sqlite import DB_FILENAME
from coordinator.storage.checkpoints import CheckpointStore, EntryKind
from coordinator.storage.job_blobs import JobBlobStores
from coordinator.storage.working_state import ParamsStore
from geofed.blobstore import FsBlobStore
from regional_agent.handoff.directory import HandoffDir
from tests.support.federation import FederationRun, operator_cli
from tests.support.observe import (
    ControlObserver,
    audit_entries,
    observed_federation,
    poll,
    sample,
)

# Five scenarios on one federation, 35 to 55 s here: 420 s leaves a slow machine its
# margin over the default 300.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]

REGIONS = ("eu-west", "us-east")
JOBS = ("alpha", "beta")
ROUNDS = 3
#: The rounds of each job that waits for capacity.
GANG_ROUNDS = 2
#: The snapshot interval's job: rounds of a few seconds, so the test sees θ_2 and kills
#: eu-west well before round 2 ends.
SNAPSHOT_ROUNDS = 6
SNAPSHOT_INNER_STEPS = 40
KILLED = "eu-west"
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


async def test_jobs_on_the_same_regions(tmp_path: Path) -> None:
    async with observed_federation(
        tmp_path, regions=REGIONS, rounds=ROUNDS, inner_steps=3, customize=priced, submit=False
    ) as (fed, observer):
        await jobs_sharing_regions_keep_their_own_regional_state(fed)
        await a_job_waits_for_capacity_and_starts_when_it_frees(fed)
        await a_production_job_preempts_a_research_job_at_a_round_boundary(fed)
        # Last: the failure it injects counts against eu-west for every later job.
        await the_snapshot_interval_adapts_to_the_measured_cost_and_failures(fed)
        await a_round_a_region_refuses_itself_is_audited(fed, observer)


async def jobs_sharing_regions_keep_their_own_regional_state(fed: FederationRun) -> None:
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
    await wait_gone(fed, [handoff(fed, r).checkpoint_path(job) for r in REGIONS for job in JOBS])
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


async def regions_with_capacity(fed: FederationRun, timeout_s: float = 120.0) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    regions: list[Any] = []
    while time.monotonic() < deadline:
        fed.children.check_alive()
        every = (await fed.get("/v1/regions"))["regions"]
        regions = [r for r in every if r["region"] in fed.regions]
        if all(r["state"] != "offline" and r.get("capacity") for r in regions):
            return regions
        await asyncio.sleep(0.3)
    raise AssertionError(f"regions never declared capacity: {regions}\n{fed.log_tails()}")


async def a_job_waits_for_capacity_and_starts_when_it_frees(fed: FederationRun) -> None:
    regions = await regions_with_capacity(fed)
    for region in regions:
        assert region["capacity"]["cpu_slots"] == 1, region
        assert region["capacity"]["gpus"] == 0, region
        assert region["in_use"] == {"gpus": 0, "cpu_slots": 0, "jobs": []}

    spec = {**fed.job_spec(), "rounds": GANG_ROUNDS}
    gang_a = {**spec, "job": "gang-a", "needs": {"cpu_slots": 1}, "team": "nlp"}
    gang_b = {**spec, "job": "gang-b", "needs": {"cpu_slots": 1}, "priority": "best-effort"}
    status, body = await fed.submit(gang_a)
    assert status == 201, body
    assert body["state"] == "running", body
    status, body = await fed.submit(gang_b)
    assert status == 201, body
    assert body["state"] == "queued", body

    queued = await fed.status("gang-b")
    assert queued["state"] == "queued"
    assert (queued["priority"], queued["team"]) == ("best-effort", "default")
    assert queued["queue"]["position"] == 1
    assert "0 of 1 CPU worker slots free" in queued["queue"]["reason"], queued
    # A lower class does not stop a running job: it waits for it to end.
    assert "gang-a (research) is not 1 below best-effort" in queued["queue"]["reason"]
    running = await fed.status("gang-a")
    assert (running["priority"], running["team"], running["queue"]) == (
        "research",
        "nlp",
        None,
    )
    queue = (await fed.get("/v1/queue"))["jobs"]
    assert [(j["job"], j["state"], j["position"]) for j in queue] == [
        ("gang-b", "queued", 1),
        ("gang-a", "running", None),
    ]
    assert queue[0]["wait_s"] >= 0
    for region in (await fed.get("/v1/regions"))["regions"]:
        if region["region"] not in fed.regions:
            continue
        assert region["in_use"] == {"gpus": 0, "cpu_slots": 1, "jobs": ["gang-a"]}
    metrics = await fed.metrics_text()
    assert sample(metrics, "geofed_jobs_queued", priority="best-effort") == 1
    assert sample(metrics, "geofed_jobs", state="queued") == 1

    await fed.wait_for(
        lambda s: s.get("state") == "completed", timeout_s=240, what="gang-a", job="gang-a"
    )
    final = await fed.wait_for(
        lambda s: s.get("state") == "completed" and s.get("round") == GANG_ROUNDS,
        timeout_s=240,
        what="gang-b to be admitted and complete",
        job="gang-b",
    )
    assert final["queue"] is None

    entries = await audit_entries(fed, job="gang-b")
    admits = [e for e in entries if e.action == "job.admit"]
    assert [e.verdict for e in admits] == ["allow", "ok"], admits
    assert admits[1].details["from"] == "queued"
    assert "admitted on 2 region(s)" in admits[1].details["reason"], admits
    metrics = await fed.metrics_text()
    assert sample(metrics, "geofed_jobs_queued", priority="best-effort") == 0


async def a_production_job_preempts_a_research_job_at_a_round_boundary(
    fed: FederationRun,
) -> None:
    spec = {**fed.job_spec(), "needs": {"cpu_slots": 1}, "snapshot_every": 10}
    research = {**spec, "job": "research-job", "rounds": 5}
    production = {**spec, "job": "production-job", "rounds": 2, "priority": "production"}
    status, body = await fed.submit(research)
    assert (status, body["state"]) == (201, "running"), body
    # At once, so that the research job cannot have ended: it stops after round 0.
    status, body = await fed.submit(production)
    assert (status, body["state"]) == (201, "queued"), body
    assert "preempting research-job at their round boundary" in body["queue"]["reason"]

    stopped = await fed.wait_for(
        lambda s: s.get("state") == "queued" and s.get("queue") is not None,
        timeout_s=120,
        what="research-job preempted",
        job="research-job",
    )
    assert stopped["queue"]["position"] >= 1
    await fed.wait_for(
        lambda s: s.get("state") == "completed",
        timeout_s=180,
        what="production-job",
        job="production-job",
    )
    final = await fed.wait_for(
        lambda s: s.get("state") == "completed" and s.get("round") == 5,
        timeout_s=240,
        what="research-job resumed and completed",
        job="research-job",
    )
    assert final["queue"] is None

    entries = await audit_entries(fed, job="research-job")
    actions = [(e.action, e.verdict) for e in entries if e.action.startswith("job.")]
    assert actions == [
        ("job.admit", "allow"),  # residency; queued for capacity
        ("job.admit", "ok"),  # started at once: the regions were free
        ("job.preempt", "ok"),
        ("job.admit", "ok"),  # resumed once production-job completed
    ], actions
    (preempt,) = [e for e in entries if e.action == "job.preempt"]
    assert preempt.round is not None
    assert stopped["round"] == preempt.round
    assert "for production-job (production over research)" in preempt.details["reason"]
    # Stopped at a boundary: no round was lost, failed or run twice (the counter of the
    # last round moves once its publication is finished, just after the job completes).
    metrics = await fed.metrics_text()
    deadline = time.monotonic() + 30
    while sample(metrics, "geofed_rounds_completed_total", job="research-job") < 5:
        assert time.monotonic() < deadline, metrics
        await asyncio.sleep(0.2)
        metrics = await fed.metrics_text()
    assert sample(metrics, "geofed_rounds_completed_total", job="research-job") == 5
    assert sample(metrics, "geofed_preemptions_total", priority="research") == 1
    assert sample(metrics, "geofed_rounds_failed_total", job="research-job") == 0

    # Preemption changed nothing a job trains: the same jobs run alone, one after the
    # other on the same regions, end with the same parameters, bit for bit.
    shared = {
        job: (await fed.status(job))["params_hash"] for job in ("research-job", "production-job")
    }
    for job, alone in ((research, "research-alone"), (production, "production-alone")):
        status, body = await fed.submit({**job, "job": alone})
        assert (status, body["state"]) == (201, "running"), body
        done = await fed.wait_for(
            lambda s: s.get("state") == "completed",
            timeout_s=180,
            what=f"{alone} run alone",
            job=alone,
        )
        assert done["params_hash"] is not None
        assert done["params_hash"] == shared[job["job"]], (job["job"], done, shared)


async def poll_status(
    fed: FederationRun, predicate: Callable[[dict[str, Any]], bool], timeout_s: float, what: str
) -> dict[str, Any]:
    """The job's status once ``predicate`` holds (an agent may be down meanwhile)."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        last = await fed.status()
        if predicate(last):
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last status {last}\n{fed.log_tails()}")


def snapshot_rounds(fed: FederationRun, location: str) -> list[int]:
    root = fed.work / "checkpoints" / location
    store = CheckpointStore(location, root, blobs=FsBlobStore(root / "blobs"))
    return [e.round for e in store.entries(fed.job) if e.kind is EntryKind.SNAPSHOT]


async def the_snapshot_interval_adapts_to_the_measured_cost_and_failures(
    fed: FederationRun,
) -> None:
    spec: dict[str, Any] = {
        **fed.job_spec(),
        "rounds": SNAPSHOT_ROUNDS,
        "inner_steps": SNAPSHOT_INNER_STEPS,
        "snapshot_every": "auto",
        "snapshot_min_rounds": 2,
        "snapshot_max_rounds": 4,
        # No evaluations, so no loss trend stretches the interval: it follows the
        # measured cost and failures alone (the stretch: tests/unit/test_loss_trend.py).
        "evaluation": {"where": "none"},
    }
    spec.pop("retention", None)
    status, body = await fed.submit(spec)
    assert status == 201, body
    first = body.get("snapshot") or (await fed.status())["snapshot"]
    assert (first["mode"], first["every_rounds"]) == ("auto", 2), first
    assert "no snapshot cost measured yet" in first["reason"], first

    # θ_2's snapshot measured the cost; no failure yet: the longest interval.
    measured = await poll_status(
        fed, lambda s: s["snapshot"]["last_round"] == 2, 120, "θ_2's snapshot"
    )
    plan = measured["snapshot"]
    assert plan["every_rounds"] == 4, plan
    assert "no failures measured yet" in plan["reason"], plan
    assert plan["cost_s"] > 0, plan
    assert plan["mtbf_s"] is None, plan
    assert plan["next_round"] == 6, plan
    location = measured["checkpoint_location"]
    assert snapshot_rounds(fed, location) == [0, 2]
    assert sample(await fed.metrics_text(), "geofed_job_snapshot_interval_rounds", job=fed.job) == 4

    # eu-west fails while it serves the job; the round cannot end without it.
    await fed.kill(f"agent-{KILLED}")
    failed = await poll_status(
        fed, lambda s: "measured MTBF" in s["snapshot"]["reason"], 60, "the failure"
    )
    plan = failed["snapshot"]
    assert f"{KILLED}: 1 in" in plan["reason"], plan
    assert "went offline" in plan["reason"], plan
    assert plan["mtbf_s"] > 0, plan
    assert plan["tau_s"] is not None, plan
    # τ = √(2·δ·M) is far below a round here: the job's minimum.
    assert plan["every_rounds"] == 2, plan
    assert "raised to the job's minimum 2" in plan["reason"], plan
    assert failed["round"] == 2, failed  # round 2 waits for eu-west
    await fed.restart(f"agent-{KILLED}")

    final = await fed.wait_for(
        lambda s: s.get("state") == "completed", timeout_s=150, what="the job to complete"
    )
    # θ_3 came 1 round after θ_2 (no snapshot under either interval); from θ_4 on
    # every 2nd round: the chain holds exactly the chosen rounds.
    assert snapshot_rounds(fed, location) == [0, 2, 4, 6]
    done = final["snapshot"]
    assert (done["last_round"], done["every_rounds"]) == (6, 2), done
    assert "measured MTBF" in done["reason"], done


async def a_round_a_region_refuses_itself_is_audited(
    fed: FederationRun, observer: ControlObserver
) -> None:
    job = "refused"
    spec = fed.job_spec()
    spec = {**spec, "job": job, "regions": {**spec["regions"], "eu-west": ["eu-support-chats"]}}
    status, body = await fed.submit(spec)
    assert status == 201, body

    def refused() -> bool:
        return any(
            s.region == "eu-west" and s.refused and s.job == job for _, s in observer.statuses
        )

    await poll(fed, refused, "eu-west to refuse the job's round")

    async def refusals() -> list[Any]:
        return [e for e in await audit_entries(fed, job=job) if e.action == "round.refuse"]

    async with asyncio.timeout(20):
        while not (entries := await refusals()):  # noqa: ASYNC110 - the audit log has no event
            await asyncio.sleep(0.2)
    [entry] = entries
    assert (entry.region, entry.round, entry.verdict) == ("eu-west", 0, "deny")
    assert entry.actor.endswith("/region/eu-west")
    reason = entry.details["reason"]
    assert "trains region eu-west on eu-support-chats, which this agent does not" in reason
    assert "(its datasets: eu-parliament-proceedings)" in reason
