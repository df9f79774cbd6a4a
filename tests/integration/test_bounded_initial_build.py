"""A job's θ_0 is built within the coordinator's budget, whatever the task's code does.

A coordinator (real HTTPS with client certificates, SQLite, an embedded broker) gets jobs
of a task whose model cannot be built on the meta device, so nothing counts it in
advance: it is built in a child process. Built there, θ_0 is the task's own (the job
runs from it). A build that holds more memory than ``limits.max_task_bytes``, or takes
longer than ``limits.build_timeout_s``, is stopped and the job refused 400 naming the
limit; the coordinator serves on, no child and no scratch file are left behind. A task
that builds on the meta device is not built at submission (its tensors come from there);
one whose real θ_0 differs from its meta build fails when it starts, saying so.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from coordinator.jobs.initial_build import initial_parameters
from geofed.api_paths import ApiPaths
from geofed.control.broker import EmbeddedBroker
from geofed.params import parameters_vector_hash
from tests.support.coordinator import coordinator, job_yaml, request, write_setup
from tests.support.off_meta_task import SHIFTING_SPEC, SPEC, OffMetaOptions, OffMetaTask
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

LIMITS = "limits: {max_task_bytes: 805306368, build_timeout_s: 6, "


def _job(name: str, **options: float) -> str:
    extra = "".join(f", {key}: {value}" for key, value in options.items())
    return job_yaml(name, task=SPEC).replace(
        "options: {hidden: 8}", f"options: {{hidden: 8{extra}}}"
    )


async def job_once(
    operator: aiohttp.ClientSession, job: str, holds: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """``job``'s status once ``holds`` is true of it (30 s at most)."""
    latest: dict[str, Any] = {}

    async def check() -> bool:
        _, latest["body"] = await request(operator, "GET", ApiPaths.job(job))
        return holds(latest["body"])

    try:
        await eventually(check, timeout_s=30, poll_s=0.05)
    except TimeoutError:
        pytest.fail(f"job {job} never got there: {latest.get('body')}")
    return dict(latest["body"])


async def test_a_task_s_build_runs_bounded_in_a_child_process(tmp_path: Path) -> None:
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)
        text = setup.config_path.read_text()
        assert "limits: {" in text
        setup.config_path.write_text(text.replace("limits: {", LIMITS, 1))
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)

            # Over the memory budget: stopped, refused, naming the limit.
            status, body = await request(
                operator, "POST", ApiPaths.JOBS, data=_job("heavy", ballast_mib=1536)
            )
            assert (status, body["error"]) == (400, "bad_request"), body
            assert "building θ_0 took more than 0.75 GiB of memory" in body["message"], body
            assert "limits.max_task_bytes" in body["message"]
            # Over the time budget: stopped alike.
            status, body = await request(
                operator, "POST", ApiPaths.JOBS, data=_job("slow", build_s=60)
            )
            assert (status, body["error"]) == (400, "bad_request"), body
            assert "building θ_0 took longer than 6 s" in body["message"], body

            # Within both: built in the child, and the job runs from the task's θ_0.
            status, body = await request(operator, "POST", ApiPaths.JOBS, data=_job("fits"))
            assert status == 201, body
            expected = parameters_vector_hash(
                initial_parameters(OffMetaTask(OffMetaOptions(hidden=8)), seed=0)
            )
            job = await job_once(operator, "fits", lambda job: bool(job.get("params_hash")))
            assert job["params_hash"] == expected, job

            # A task built on meta is not built at submission: the shapes come from there,
            # and a real θ_0 that does not have them fails the job when it starts.
            shifting = job_yaml("shifting", task=SHIFTING_SPEC)
            status, body = await request(operator, "POST", ApiPaths.JOBS, data=shifting)
            assert status == 201, body
            job = await job_once(operator, "shifting", lambda job: job.get("state") == "failed")
            assert job["error"].startswith("θ_0: the task's model is not its meta build:"), job
            assert "differ in shape" in job["error"], job
            _, jobs = await request(operator, "GET", ApiPaths.JOBS)
            assert [j["job"] for j in jobs["jobs"]] == ["fits", "shifting"]
        assert multiprocessing.active_children() == []
        assert list((setup.root / "state" / "build").iterdir()) == []
