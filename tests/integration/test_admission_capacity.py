"""Gang admission against the capacity the agents declare, with real processes.

A coordinator and two agents (embedded broker, mTLS HTTPS), each agent with one gloo
worker, so each region declares one CPU worker slot. Two jobs each need one slot in both
regions: ``alpha`` starts; ``beta`` is queued, and ``GET /v1/jobs/beta``,
``GET /v1/queue``, ``GET /v1/regions`` and ``geofed_jobs_queued`` say why and what is
in use. When ``alpha`` completes, its slots free, ``beta`` is admitted (audited with the
reason) and completes. Then preemption: a ``production`` job arriving while a
``research`` job runs stops it at its next round boundary (its current round completes
and is published), runs, and the research job resumes from the round where it stopped
and completes: no round lost, failed or run twice, and both end with the parameters
the same jobs reach when each runs alone.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.federation import FederationRun, running_federation
from tests.support.observe import audit_entries, sample

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]

ROUNDS = 2


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


async def test_jobs_wait_for_capacity_and_a_production_job_preempts_a_research_job(
    tmp_path: Path,
) -> None:
    async with running_federation(
        tmp_path, regions=("eu-west", "us-east"), rounds=ROUNDS, inner_steps=3
    ) as fed:
        await a_job_waits_for_capacity_and_starts_when_it_frees(fed)
        await a_production_job_preempts_a_research_job_at_a_round_boundary(fed)


async def a_job_waits_for_capacity_and_starts_when_it_frees(fed: FederationRun) -> None:
    regions = await regions_with_capacity(fed)
    for region in regions:
        assert region["capacity"]["cpu_slots"] == 1, region
        assert region["capacity"]["gpus"] == 0, region
        assert region["in_use"] == {"gpus": 0, "cpu_slots": 0, "jobs": []}

    spec = fed.job_spec()
    alpha = {**spec, "job": "alpha", "needs": {"cpu_slots": 1}, "team": "nlp"}
    beta = {**spec, "job": "beta", "needs": {"cpu_slots": 1}, "priority": "best-effort"}
    status, body = await fed.submit(alpha)
    assert status == 201, body
    assert body["state"] == "running", body
    status, body = await fed.submit(beta)
    assert status == 201, body
    assert body["state"] == "queued", body

    queued = await fed.status("beta")
    assert queued["state"] == "queued"
    assert (queued["priority"], queued["team"]) == ("best-effort", "default")
    assert queued["queue"]["position"] == 1
    assert "0 of 1 CPU worker slots free" in queued["queue"]["reason"], queued
    # A lower class does not stop a running job: it waits for it to end.
    assert "alpha (research) is not 1 below best-effort" in queued["queue"]["reason"]
    running = await fed.status("alpha")
    assert (running["priority"], running["team"], running["queue"]) == (
        "research",
        "nlp",
        None,
    )
    queue = (await fed.get("/v1/queue"))["jobs"]
    assert [(j["job"], j["state"], j["position"]) for j in queue] == [
        ("beta", "queued", 1),
        ("alpha", "running", None),
    ]
    assert queue[0]["wait_s"] >= 0
    for region in (await fed.get("/v1/regions"))["regions"]:
        if region["region"] not in fed.regions:
            continue
        assert region["in_use"] == {"gpus": 0, "cpu_slots": 1, "jobs": ["alpha"]}
    metrics = await fed.metrics_text()
    assert sample(metrics, "geofed_jobs_queued", priority="best-effort") == 1
    assert sample(metrics, "geofed_jobs", state="queued") == 1

    await fed.wait_for(
        lambda s: s.get("state") == "completed", timeout_s=240, what="alpha", job="alpha"
    )
    final = await fed.wait_for(
        lambda s: s.get("state") == "completed" and s.get("round") == ROUNDS,
        timeout_s=240,
        what="beta to be admitted and complete",
        job="beta",
    )
    assert final["queue"] is None

    entries = await audit_entries(fed, job="beta")
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
