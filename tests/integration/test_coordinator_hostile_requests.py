"""Hostile requests against a real coordinator over TLS: nothing imported, stalled or held.

Each test sends what a hostile or broken client would (a task spec naming an arbitrary
module, integers past SQLite's range, a body that will never arrive, unfinished
headers, bytes aiohttp's parser refuses, a job spec built to be slow to parse) and checks
the answer, its shape, and that every other client is still served.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from geofed.control.broker import EmbeddedBroker
from tests.support.coordinator import Running, coordinator, job_yaml, request, write_setup
from tests.support.pki import Principal

pytestmark = pytest.mark.integration

_MARKER_MODULE = "geofed_import_marker_task"


async def test_a_task_module_outside_the_allow_list_is_refused_before_it_is_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A module that leaves a marker file when imported, importable by the coordinator.
    marker = tmp_path / "imported"
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / f"{_MARKER_MODULE}.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('imported')\n"
    )
    monkeypatch.syspath_prepend(str(modules))
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path / "setup", broker.port)
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            spec = job_yaml(task=f"{_MARKER_MODULE}:Task")
            status, body = await request(operator, "POST", "/v1/jobs", data=spec)
            assert (status, body["error"]) == (400, "bad_request"), body
            assert f"task module {_MARKER_MODULE!r} is not in" in body["message"]
            assert "geofed.examples.*" in body["message"]
            # The standard library's own side effects are refused the same way.
            status, body = await request(operator, "POST", "/v1/jobs", data=job_yaml(task="this:T"))
            assert (status, body["error"]) == (400, "bad_request"), body
            status, body = await request(operator, "GET", "/v1/jobs/tiny")
            assert status == 404, body
    assert not marker.exists()
    assert _MARKER_MODULE not in sys.modules


_HUGE = "99999999999999999999999"


async def _open(
    running: Running, principal: Principal
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw TLS connection to the coordinator presenting ``principal``'s certificate."""
    context = principal.client_context(running.setup.bundle())
    return await asyncio.open_connection(
        "127.0.0.1", running.port, ssl=context, server_hostname="localhost"
    )


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of one HTTP/1.1 response."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


async def test_integers_past_the_store_are_refused_and_a_refused_upload_is_audited(
    tmp_path: Path,
) -> None:
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            status, body = await request(operator, "GET", f"/v1/audit?after={_HUGE}")
            assert (status, body["error"]) == (400, "bad_request"), body
            region = running.region("eu-west").session
            path = f"/v1/jobs/tiny/rounds/{_HUGE}/deltas/eu-west/manifest"
            status, body = await request(region, "PUT", path, data=b"{}")
            assert (status, body["error"]) == (404, "not_found"), body
            status, audit = await request(operator, "GET", "/v1/audit?job=tiny")
            assert status == 200, audit
            [entry] = audit["entries"]
            assert (entry["action"], entry["verdict"], entry["round"]) == (
                "delta.reject",
                "deny",
                None,
            )
            assert entry["details"]["round"] == _HUGE


async def test_a_body_declared_past_its_limit_is_refused_at_once(tmp_path: Path) -> None:
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            reader, writer = await _open(running, setup.regions["eu-west"])
            started = time.monotonic()
            writer.write(
                b"PUT /v1/jobs/tiny/rounds/0/deltas/eu-west/manifest HTTP/1.1\r\n"
                b"Host: localhost\r\nContent-Length: 1099511627776\r\n\r\n{"
            )
            async with asyncio.timeout(4):  # upload_s is 5: the old answer came then, a 408
                status, headers, body = await _answer(reader)
            writer.transport.abort()  # the server would otherwise linger over the body
            await asyncio.sleep(0.2)  # and sees it gone before it shuts down
            assert time.monotonic() - started < 2
            assert status == 413
            assert headers["content-type"].startswith("application/json")
            assert json.loads(body)["error"] == "too_large"


async def test_unfinished_headers_are_cut_off_and_parser_errors_answer_json(
    tmp_path: Path,
) -> None:
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)  # request_s: 2
        async with coordinator(setup) as running:
            reader, writer = await _open(running, setup.operator)
            started = time.monotonic()
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
            async with asyncio.timeout(8):
                rest = await reader.read()
            assert rest == b""  # closed without an answer
            assert 1.5 < time.monotonic() - started < 6
            writer.close()

            reader, writer = await _open(running, setup.operator)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nBad Header\r\n\r\n")
            async with asyncio.timeout(4):
                status, headers, body = await _answer(reader)
            writer.close()
            assert status == 400
            assert headers["content-type"].startswith("application/json")
            answer = json.loads(body)
            assert answer["error"] == "bad_request"
            assert answer["message"]


def _slow_spec(limit: int) -> bytes:
    """A job spec of flat scalars as close to ``limit`` bytes as fits: slow to parse."""
    head = "job: slow\ntask: {spec: tests.support.tiny_task:TinyTask}\nflat:\n"
    lines, size, index = [head], len(head), 0
    while size + 16 < limit:
        line = f"  k{index}: {index}\n"
        lines.append(line)
        size += len(line)
        index += 1
    return "".join(lines).encode()


async def test_healthz_answers_while_hostile_job_specs_are_parsed(tmp_path: Path) -> None:
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            observer = running.session(setup.observer)
            for session in (operator, observer):  # connections up before the timing starts
                status, _ = await request(session, "GET", "/healthz")
                assert status == 200
            body = _slow_spec(1 << 20)  # max_job_spec_bytes, the default

            async def submit_all() -> list[tuple[int, dict[str, Any]]]:
                # One hostile body after another, so one is always being parsed.
                return [await request(operator, "POST", "/v1/jobs", data=body) for _ in range(6)]

            submits = asyncio.create_task(submit_all())
            probes: list[tuple[float, float]] = []  # (start, latency) of each /healthz
            while not submits.done():
                started = time.monotonic()
                status, answer = await request(observer, "GET", "/healthz")
                probes.append((started, time.monotonic() - started))
                assert (status, answer) == (200, {"status": "ok"})
                await asyncio.sleep(0.01)
            for status, answer in await submits:
                assert (status, answer["error"]) == (400, "bad_request"), answer
                assert "more than 10000 nodes" in answer["message"]
            assert len(probes) >= 3, probes  # the parses took a while, and /healthz ran
            assert max(latency for _, latency in probes) < 0.1, probes
            # Nor did the loop stall between probes (each waits 10 ms after the last).
            starts = [start for start, _ in probes]
            gaps = [b - a for a, b in itertools.pairwise(starts)]
            assert max(gaps) < 0.15, gaps


async def test_deeply_nested_job_specs_are_refused_naming_the_line(tmp_path: Path) -> None:
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            for body in ("job: deep\nrounds: " + "[" * 100_000, '{"job": ' + "[" * 100_000):
                status, answer = await request(operator, "POST", "/v1/jobs", data=body)
                assert (status, answer["error"]) == (400, "bad_request"), answer
                assert answer["problems"][0].startswith(("request:1: ", "request:2: ")), answer
                assert len(answer["message"]) < 1000
