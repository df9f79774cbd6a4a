"""What a region learns of jobs it is not in: nothing, over real mutual TLS.

Job ``tiny`` runs in eu-west and us-east. ap-south, a region of the federation but not of
the job, reads the coordinator as a curious region would: ``/metrics`` (where the job's
series are), the job's status, its downloads and its upload URLs. Every job-scoped answer
must be exactly what a job that does not exist gets, and the metrics are not a region's
to read at all; the job's own regions and the readers still see it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from geofed.api_paths import ApiPaths
from geofed.control.broker import EmbeddedBroker
from tests.support.coordinator import coordinator, job_yaml, request, write_setup

pytestmark = pytest.mark.integration

UNKNOWN = "nosuch"


def _paths(job: str) -> list[tuple[str, str]]:
    digest = "ab" * 32
    return [
        ("GET", ApiPaths.job(job)),
        ("GET", ApiPaths.update(job, 0)),
        ("GET", ApiPaths.latest_checkpoint(job)),
        ("GET", ApiPaths.artifact(job, digest)),
        ("PUT", ApiPaths.delta_manifest(job, 0, "ap-south")),
        ("PUT", ApiPaths.delta_chunk(job, 0, "ap-south", 0)),
        ("POST", ApiPaths.delta_commit(job, 0, "ap-south")),
        ("PUT", ApiPaths.delta(job, 0, "ap-south")),
    ]


async def _answer(session: aiohttp.ClientSession, method: str, path: str) -> tuple[int, Any]:
    return await request(session, method, path, data=b"{}")


async def test_a_region_learns_nothing_of_jobs_it_is_not_in(tmp_path: Path) -> None:
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            status, body = await request(operator, "POST", "/v1/jobs", data=job_yaml())
            assert status == 201, body
            observer = running.session(setup.observer)
            async with observer.get("/metrics") as response:
                assert response.status == 200
                scraped = await response.text()
            assert 'job="tiny"' in scraped  # there is something to leak

            outsider = running.session(setup.regions["ap-south"])
            member = running.session(setup.regions["eu-west"])
            # No coordinator metrics for regions, in the job or not.
            for region in (outsider, member):
                async with region.get("/metrics") as response:
                    text = await response.text()
                    assert response.status == 403, text
                assert "tiny" not in text
                assert "geofed_" not in text
                # Nor what jobs use and cost: that is for operators and observers.
                for path in (ApiPaths.USAGE, f"{ApiPaths.USAGE}?job=tiny"):
                    status, body = await request(region, "GET", path)
                    assert (status, body["error"]) == (403, "forbidden"), body
            status, body = await request(observer, "GET", f"{ApiPaths.USAGE}?job=tiny")
            assert status == 200, body
            status, body = await request(observer, "GET", f"{ApiPaths.USAGE}?job={UNKNOWN}")
            assert (status, body["error"]) == (404, "not_found"), body

            # Every job-scoped answer to ap-south: the same as for a job that does not exist.
            for (method, forbidden), (_, unknown) in zip(
                _paths("tiny"), _paths(UNKNOWN), strict=True
            ):
                got_forbidden = await _answer(outsider, method, forbidden)
                got_unknown = await _answer(outsider, method, unknown)
                assert got_forbidden[0] == got_unknown[0] == 404, (forbidden, got_forbidden)
                assert got_forbidden[1] == {"error": "not_found", "message": "no job tiny"}
                assert got_unknown[1] == {"error": "not_found", "message": f"no job {UNKNOWN}"}

            # The job's own region and the readers still see it.
            status, body = await request(member, "GET", ApiPaths.job("tiny"))
            assert (status, body["job"]) == (200, "tiny"), body
            assert "spec" not in body  # the full spec is for readers
            status, body = await request(observer, "GET", ApiPaths.job("tiny"))
            assert (status, body["spec"]["job"]) == (200, "tiny"), body
            status, body = await request(observer, "GET", ApiPaths.job(UNKNOWN))
            assert (status, body["error"]) == (404, "not_found")
            # A reader may see the job but downloads are the regions': 403, not 404.
            status, body = await request(observer, "GET", ApiPaths.update("tiny", 0))
            assert (status, body["error"]) == (403, "forbidden")
