"""The queue from the command line and across a restart, on a real coordinator (mTLS).

Two regions report one CPU worker slot each (retained statuses on an embedded broker;
a third, ap-south, never reports). ``geofed job submit`` of a job needing one slot in
both starts it; a second waits, and ``geofed queue``, ``geofed job status`` and
``geofed status`` show why and what is in use. The queued job stays queued across a
coordinator restart; a third queued job is cancelled from the queue; cancelling the
running job frees its slots and the waiting one starts (``job.admit``, audited).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from coordinator import daemon
from geofed.control import Capacity, ControlClient, RegionStatus, Topics, encode
from geofed.control.broker import EmbeddedBroker
from geofed_cli import main
from tests.support.coordinator import Running, coordinator, job_yaml, request, write_setup

pytestmark = pytest.mark.integration

NEEDS = "needs: {cpu_slots: 1}\n"


async def _report_capacity(port: int, regions: tuple[str, ...]) -> None:
    client = ControlClient("127.0.0.1", port, client_id="agents", timeout_s=5.0)
    task = asyncio.create_task(client.run())
    for region in regions:
        status = RegionStatus(
            region=region, state="online", agent_version="t", capacity=Capacity(cpu_slots=1)
        )
        await client.publish(Topics("acme").region_status(region), encode(status), retain=True)
    await client.close(timeout_s=5.0)
    await asyncio.wait([task])


async def _geofed(*argv: str) -> int:
    return await asyncio.to_thread(main, list(argv))


async def _until(
    session: aiohttp.ClientSession, path: str, check: Any, what: str, timeout_s: float = 20.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status, body = await request(session, "GET", path)
        if status == 200 and check(body):
            return body
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what}: last {body}")


def _capacity_known(body: dict[str, Any]) -> bool:
    known = {r["region"]: r["capacity"] for r in body["regions"]}
    return bool(known["eu-west"] and known["us-east"])


async def test_the_queue_from_the_command_line_and_across_a_restart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)
        with setup.config_path.open("a") as config:
            config.write("admins: [ops]\n")  # it submits and cancels team nlp's job too
        await _report_capacity(broker.port, ("eu-west", "us-east"))
        monkeypatch.setenv("GEOFED_CERT", str(setup.operator.cert_file))
        monkeypatch.setenv("GEOFED_KEY", str(setup.operator.key_file))
        monkeypatch.setenv("GEOFED_TRUST", str(setup.fed.bundle_file))
        specs = {}
        for name, extra in (
            ("first", NEEDS + "team: nlp\n"),
            ("second", NEEDS + "priority: production\n"),
            ("third", NEEDS + "priority: best-effort\n"),
        ):
            specs[name] = tmp_path / f"{name}.yaml"
            specs[name].write_text(job_yaml(name, extra=extra, rounds=50))

        async with coordinator(setup) as running:
            monkeypatch.setenv("GEOFED_URL", running.url)
            operator = running.session(setup.operator)
            regions = await _until(operator, "/v1/regions", _capacity_known, "capacity")
            shown = {r["region"]: r for r in regions["regions"]}
            assert shown["eu-west"]["capacity"]["cpu_slots"] == 1
            assert shown["ap-south"]["capacity"] is None  # never reported: unknown

            assert await _geofed("job", "submit", str(specs["first"])) == 0
            assert "job first admitted: running" in capsys.readouterr().out
            assert await _geofed("job", "submit", str(specs["second"])) == 0
            assert "job second admitted: queued" in capsys.readouterr().out
            # A priority class the coordinator does not have is refused at submission.
            unknown = tmp_path / "unknown.yaml"
            unknown.write_text(job_yaml("unknown", extra=NEEDS + "priority: urgent\n"))
            assert await _geofed("job", "submit", str(unknown)) == 1
            assert "'urgent' is not a priority class" in capsys.readouterr().err

            assert await _geofed("queue") == 0
            lines = capsys.readouterr().out.splitlines()
            assert lines[0].split() == [
                "POSITION", "JOB", "STATE", "PRIORITY", "TEAM", "WAIT", "ESTIMATE", "REASON"
            ]  # fmt: skip
            assert lines[1].split()[:5] == ["1", "second", "queued", "production", "default"]
            assert "0 of 1 CPU worker slots free" in lines[1]
            assert lines[2].split()[:5] == ["-", "first", "running", "research", "nlp"]
            assert lines[2].split()[5:7] == ["-", "-"], "no wait; no price table, no estimate"

            assert await _geofed("job", "status", "second") == 0
            out = capsys.readouterr().out
            assert "job second: queued" in out
            assert "queued since" in out
            assert "(position 1)" in out

            assert await _geofed("status") == 0
            out = capsys.readouterr().out
            assert "CAPACITY" in out
            assert "IN_USE" in out
            eu = next(line for line in out.splitlines() if line.startswith("eu-west"))
            # Capacity and use; the test's regions report no hardware (HARDWARE "-").
            assert eu.split()[-5:] == ["1", "slots", "1/1", "slots", "-"], eu

        # Restarted, the coordinator still holds the queue; statuses come back retained.
        async with coordinator(setup) as running:
            monkeypatch.setenv("GEOFED_URL", running.url)
            operator = running.session(setup.operator)
            await _until(operator, "/v1/regions", _capacity_known, "capacity after restart")
            second = await _until(
                operator,
                "/v1/jobs/second",
                lambda b: b["queue"] is not None,
                "second queued after the restart",
            )
            assert second["state"] == "queued"
            assert "0 of 1 CPU worker slots free" in second["queue"]["reason"]

            # A queued job can be cancelled from the queue.
            assert await _geofed("job", "submit", str(specs["third"])) == 0
            assert "queued" in capsys.readouterr().out
            assert await _geofed("job", "cancel", "third") == 0
            _, queue = await request(operator, "GET", "/v1/queue")
            assert [j["job"] for j in queue["jobs"]] == ["second", "first"]

            # The running job ends: its slots free and the waiting job starts.
            assert await _geofed("job", "cancel", "first") == 0
            started = await _until(
                operator, "/v1/jobs/second", lambda b: b["state"] == "running", "second started"
            )
            assert started["queue"] is None
            _, audit = await request(operator, "GET", "/v1/audit?job=second")
            admits = [e for e in audit["entries"] if e["action"] == "job.admit"]
            assert [e["verdict"] for e in admits] == ["allow", "ok"]
            assert "job first cancelled" in admits[1]["details"]["reason"]
            regions = await _until(operator, "/v1/regions", _capacity_known, "capacity")
            in_use = {r["region"]: r["in_use"]["jobs"] for r in regions["regions"]}
            assert in_use == {"eu-west": ["second"], "us-east": ["second"], "ap-south": []}
            assert await _geofed("job", "cancel", "second") == 0


async def test_running_jobs_without_needs_are_not_held_back(tmp_path: Path) -> None:
    """Jobs that state no needs start at once on regions that report no capacity."""
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            for name in ("one", "two", "three"):
                status, body = await request(operator, "POST", "/v1/jobs", data=job_yaml(name))
                assert status == 201, body
                assert (body["state"], body["queue"], body["priority"]) == (
                    "running",
                    None,
                    "research",
                )
            await _cancel_all(running, operator, ("one", "two", "three"))


async def _cancel_all(
    running: Running, session: aiohttp.ClientSession, jobs: tuple[str, ...]
) -> None:
    for job in jobs:
        status, body = await request(session, "POST", f"/v1/jobs/{job}/cancel")
        assert status == 200, body


def test_a_bad_scheduling_file_exits_2_naming_file_line_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    setup = write_setup(tmp_path, 1)
    (tmp_path / "scheduling.yaml").write_text("priorities: {urgent: 9}\nageing: {boost: -1}\n")
    with setup.config_path.open("a") as config:
        config.write("scheduling: scheduling.yaml\n")
    assert daemon.main(setup.config_path) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'scheduling.yaml'}:2: ageing.boost: " in err, err
