"""Requests a page on another site could make an operator's browser send, over real TLS.

A coordinator (real HTTPS with client certificates, SQLite, an embedded broker) runs a
job. The operator's own client certificate sends what a hostile page would make a
browser send: a form post that pauses the job, a ``text/plain`` post of a job spec, a
``text/plain`` export grant, a ``fetch`` marked cross-site. Each is refused 403
``cross_site`` with its reason, changes nothing (the job runs on, no job or export is
made) and is audited; the same requests from the coordinator's own origin, or as the CLI
sends them, pass; reads pass whoever asks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from geofed.api_paths import ApiPaths
from geofed.control.broker import EmbeddedBroker
from tests.support.coordinator import JOB, coordinator, job_yaml, request, write_setup

pytestmark = pytest.mark.integration

EVIL = {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"}


async def _send(
    session: aiohttp.ClientSession, method: str, path: str, body: bytes, headers: dict[str, str]
) -> tuple[int, dict[str, Any]]:
    async with session.request(method, path, data=body, headers=headers) as response:
        return response.status, await response.json(content_type=None)


async def test_a_page_on_another_site_changes_nothing(tmp_path: Path) -> None:
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            status, body = await request(operator, "POST", ApiPaths.JOBS, data=job_yaml())
            assert status == 201, body

            form = {"Content-Type": "application/x-www-form-urlencoded", **EVIL}
            pause = ApiPaths.job_action(JOB, "pause")
            status, body = await _send(operator, "POST", pause, b"", form)
            assert (status, body["error"]) == (403, "cross_site"), body
            assert "Sec-Fetch-Site: cross-site" in body["message"]
            # Without the fetch metadata an old browser still names the page's origin.
            status, body = await _send(
                operator, "POST", pause, b"", {"Origin": "https://evil.example"}
            )
            assert (status, body["error"]) == (403, "cross_site"), body
            spec = job_yaml("sneaky").encode()
            status, body = await _send(
                operator, "POST", ApiPaths.JOBS, spec, {"Content-Type": "text/plain"}
            )
            assert (status, body["error"]) == (403, "cross_site"), body
            assert "a body of type text/plain" in body["message"]
            grant = b'{"destination": "storage:eu-ckpt"}'
            status, body = await _send(
                operator, "POST", ApiPaths.exports(JOB), grant, {"Content-Type": "text/plain"}
            )
            assert (status, body["error"]) == (403, "cross_site"), body

            # Nothing changed: the job runs, no other job, no export.
            status, job = await request(operator, "GET", ApiPaths.job(JOB))
            assert (status, job["state"]) == (200, "running"), job
            status, jobs = await request(operator, "GET", ApiPaths.JOBS, headers=EVIL)
            assert status == 200  # a read passes whoever asks
            assert [j["job"] for j in jobs["jobs"]] == [JOB]
            _, audit = await request(operator, "GET", "/v1/audit?limit=1000")
            refused = [
                (e["details"]["method"], e["details"]["path"])
                for e in audit["entries"]
                if e["action"] == "request.cross_site" and e["verdict"] == "deny"
            ]
            assert refused == [
                ("POST", pause),
                ("POST", pause),
                ("POST", ApiPaths.JOBS),
                ("POST", ApiPaths.exports(JOB)),
            ]
            assert not [e for e in audit["entries"] if e["action"] == "export"]

            # The coordinator's own origin, or the CLI (no browser headers), may.
            own = {"Origin": running.url, "Sec-Fetch-Site": "same-origin"}
            status, body = await _send(operator, "POST", pause, b"", own)
            assert status == 200, body
            status, job = await request(operator, "GET", ApiPaths.job(JOB))
            assert job["state"] == "paused", job
            status, body = await _send(
                operator, "POST", ApiPaths.job_action(JOB, "resume"), b"", {}
            )
            assert status == 200, body
