"""Teams and quotas on a real coordinator (mTLS, embedded broker, retained statuses).

Two regions report 8 GPUs each. Team vision may hold 4 GPUs at once; each of its jobs
needs one GPU in both regions (2 GPUs). ``vision--alice`` submits three jobs (their team
defaults to hers): two run, the third waits with its team's quota as the reason in
``GET /v1/queue``, and the metrics say so. ``nlp--bob`` may neither cancel it nor submit
a job for vision (403 ``forbidden``, audited ``deny``); alice cancels one of hers and the
waiting job starts. Only an admin (the config's ``admins``) may preempt. From the
command line: ``geofed job submit --priority --team`` and ``geofed job preempt``.

GPU-hours: a team whose quota is spent waits, and still waits after a restart (usage
is rebuilt from the audit log).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from geofed.control import Capacity, ControlClient, RegionStatus, Topics, encode
from geofed.control.broker import EmbeddedBroker
from geofed_cli import main
from tests.support.coordinator import Running, Setup, coordinator, job_yaml, request, write_setup
from tests.support.observe import sample

pytestmark = pytest.mark.integration

GPU = "needs: {gpus: 1}\n"


async def _report_gpus(port: int) -> None:
    client = ControlClient("127.0.0.1", port, client_id="agents", timeout_s=5.0)
    task = asyncio.create_task(client.run())
    for region in ("eu-west", "us-east"):
        status = RegionStatus(
            region=region,
            state="online",
            agent_version="t",
            capacity=Capacity(gpus=8, gpu_kind="H100", gpu_memory_gib=80.0),
        )
        await client.publish(Topics("acme").region_status(region), encode(status), retain=True)
    await client.close(timeout_s=5.0)
    await asyncio.wait([task])


def _configure(setup: Setup, scheduling: str) -> None:
    (setup.root / "scheduling.yaml").write_text(scheduling)
    with setup.config_path.open("a") as config:
        config.write("scheduling: scheduling.yaml\nadmins: [lead]\n")


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


def _gpus_known(body: dict[str, Any]) -> bool:
    return all(
        (r["capacity"] or {}).get("gpus") == 8
        for r in body["regions"]
        if r["region"] in ("eu-west", "us-east")
    )


async def _metrics(running: Running) -> str:
    session = running.session(running.setup.observer)
    async with session.get("/metrics") as response:
        assert response.status == 200
        return await response.text()


async def test_a_job_over_its_team_quota_waits_and_other_teams_may_not_touch_it(
    tmp_path: Path,
) -> None:
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)
        _configure(
            setup,
            "teams:\n  vision: {concurrent_gpus: 4}\n  nlp: {priorities: [research]}\n",
        )
        await _report_gpus(broker.port)
        alice = setup.fed.operator("vision--alice")
        bob = setup.fed.operator("nlp--bob")
        lead = setup.fed.operator("lead")
        async with coordinator(setup) as running:
            as_alice, as_bob, as_lead = (running.session(p) for p in (alice, bob, lead))
            await _until(as_alice, "/v1/regions", _gpus_known, "GPU capacity")
            states = {}
            for name in ("one", "two", "three"):
                status, body = await request(
                    as_alice, "POST", "/v1/jobs", data=job_yaml(name, extra=GPU, rounds=50)
                )
                assert status == 201, body
                assert body["team"] == "vision", body  # the submitter's team
                states[name] = body["state"]
            assert states == {"one": "running", "two": "running", "three": "queued"}

            _, queue = await request(as_alice, "GET", "/v1/queue")
            waiting = next(j for j in queue["jobs"] if j["job"] == "three")
            assert waiting["position"] == 1
            reason = waiting["reason"]
            assert "team vision holds 4 of its 4 concurrent GPUs, job needs 2" in reason, reason
            metrics = await _metrics(running)
            assert sample(metrics, "geofed_team_quota_waiting_jobs", team="vision") == 1
            assert sample(metrics, "geofed_team_gpus_in_use", team="vision") == 4
            in_use = {"region": "eu-west", "resource": "gpus"}
            assert sample(metrics, "geofed_region_capacity_in_use", **in_use) == 2
            assert sample(metrics, "geofed_queue_oldest_wait_seconds", priority="research") > 0

            # Another team's operator may not cancel it, nor submit for vision.
            status, body = await request(as_bob, "POST", "/v1/jobs/three/cancel")
            assert status == 403, body
            assert body["error"] == "forbidden"
            message = body["message"]
            assert "belongs to team nlp and may not cancel job three of team vision" in message
            status, body = await request(
                as_bob, "POST", "/v1/jobs", data=job_yaml("four", extra=GPU + "team: vision\n")
            )
            assert status == 403, body
            assert "may submit only its jobs, not team vision's" in body["message"]
            # Nor use a class its team is not granted (production would preempt others).
            status, body = await request(
                as_bob, "POST", "/v1/jobs", data=job_yaml("five", extra="priority: production\n")
            )
            assert status == 403, body
            assert "team nlp may not submit jobs of priority production" in body["message"]
            # Nor take its model away: exports follow the job's team.
            status, body = await request(
                as_bob, "POST", "/v1/jobs/three/exports", json={"destination": "jurisdiction:EU"}
            )
            assert status == 403, body
            assert "may not take away the model of job three of team vision" in body["message"]
            # Preempting is for admins: not even the job's own team.
            status, body = await request(as_alice, "POST", "/v1/jobs/one/preempt")
            assert status == 403, body
            assert "only an admin may" in body["message"]
            _, audit = await request(as_alice, "GET", "/v1/audit?limit=1000")
            denied = [
                (e["actor"].rsplit("/", 1)[-1], e["action"], e["job"])
                for e in audit["entries"]
                if e["verdict"] == "deny"
            ]
            assert denied == [
                ("nlp--bob", "job.cancel", "three"),
                ("nlp--bob", "job.submit", "four"),
                ("nlp--bob", "job.submit", "five"),
                ("nlp--bob", "export", "three"),
                ("vision--alice", "job.preempt", "one"),
            ]
            _, three = await request(as_alice, "GET", "/v1/jobs/three")
            assert three["state"] == "queued"

            # The admin may preempt any team's job: it stops at its next round boundary.
            status, body = await request(as_lead, "POST", "/v1/jobs/two/preempt")
            assert status == 202, body
            assert body["preempting"] == "preempted by spiffe://acme/operator/lead"

            # Its own team frees GPUs: the waiting job starts.
            status, body = await request(as_alice, "POST", "/v1/jobs/one/cancel")
            assert status == 200, body
            await _until(
                as_alice, "/v1/jobs/three", lambda b: b["state"] == "running", "three started"
            )
            for job in ("two", "three"):
                status, body = await request(as_lead, "POST", f"/v1/jobs/{job}/cancel")
                assert status == 200, body


async def test_a_team_that_spent_its_gpu_hours_waits_across_a_restart(tmp_path: Path) -> None:
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)
        # 2 GPUs for ~0.5 s spend ~0.0003 GPU-hours: more than the team's 0.0001.
        _configure(setup, "teams:\n  vision: {gpu_hours: 0.0001, window_s: 3600}\n")
        await _report_gpus(broker.port)
        alice = setup.fed.operator("vision--alice")
        async with coordinator(setup) as running:
            as_alice = running.session(alice)
            await _until(as_alice, "/v1/regions", _gpus_known, "GPU capacity")
            status, body = await request(
                as_alice, "POST", "/v1/jobs", data=job_yaml("one", extra=GPU, rounds=50)
            )
            assert (status, body["state"]) == (201, "running"), body
            await asyncio.sleep(0.5)
            status, body = await request(as_alice, "POST", "/v1/jobs/one/cancel")
            assert status == 200, body
            status, body = await request(
                as_alice, "POST", "/v1/jobs", data=job_yaml("two", extra=GPU, rounds=50)
            )
            assert (status, body["state"]) == (201, "queued"), body
            assert "of its 0.0001 GPU-hours in the last 1 h" in body["queue"]["reason"], body
            metrics = await _metrics(running)
            assert sample(metrics, "geofed_team_gpu_seconds", team="vision") > 0.36

        async with coordinator(setup) as running:  # usage rebuilt from the audit log
            as_alice = running.session(alice)
            await _until(as_alice, "/v1/regions", _gpus_known, "GPU capacity after restart")
            two = await _until(
                as_alice, "/v1/jobs/two", lambda b: b["queue"] is not None, "two queued"
            )
            assert two["state"] == "queued"
            assert "GPU-hours" in two["queue"]["reason"], two


async def test_submit_with_priority_and_team_and_preempt_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)
        _configure(
            setup,
            "teams:\n  vision: {concurrent_gpus: 4}\n  nlp: {priorities: [research]}\n",
        )
        await _report_gpus(broker.port)
        lead = setup.fed.operator("lead")
        alice = setup.fed.operator("vision--alice")
        spec = tmp_path / "job.yaml"
        spec.write_text(job_yaml("cli", extra=GPU, rounds=50))
        async with coordinator(setup) as running:
            await _until(running.session(lead), "/v1/regions", _gpus_known, "GPU capacity")
            monkeypatch.setenv("GEOFED_URL", running.url)
            monkeypatch.setenv("GEOFED_TRUST", str(setup.fed.bundle_file))

            def as_(who: Any) -> None:
                monkeypatch.setenv("GEOFED_CERT", str(who.cert_file))
                monkeypatch.setenv("GEOFED_KEY", str(who.key_file))

            async def geofed(*argv: str) -> int:
                return await asyncio.to_thread(main, list(argv))

            as_(lead)
            argv = ("job", "submit", str(spec), "--priority", "production", "--team", "vision")
            assert await geofed(*argv) == 0
            assert "job cli admitted: running" in capsys.readouterr().out
            _, body = await request(running.session(lead), "GET", "/v1/jobs/cli")
            assert (body["priority"], body["team"]) == ("production", "vision")
            assert (body["spec"]["priority"], body["spec"]["team"]) == ("production", "vision")

            as_(alice)
            assert await geofed("job", "preempt", "cli") == 1
            assert "forbidden (403)" in capsys.readouterr().err
            as_(lead)
            assert await geofed("job", "preempt", "cli") == 0
            out = capsys.readouterr().out
            assert "job cli: running (stops at its next round boundary: preempted by" in out
            as_(alice)  # the job is her team's: she may cancel it
            assert await geofed("job", "cancel", "cli") == 0
            assert "job cli: cancelled" in capsys.readouterr().out


async def test_a_preemption_decided_before_a_restart_still_stops_the_job(tmp_path: Path) -> None:
    # No agent delivers, so round 0 never ends: the job is still to stop at its boundary
    # when the coordinator restarts, and the restarted one must remember it.
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)
        _configure(setup, "teams: {}\n")
        await _report_gpus(broker.port)
        lead = setup.fed.operator("lead")
        async with coordinator(setup) as running:
            session = running.session(lead)
            await _until(session, "/v1/regions", _gpus_known, "GPU capacity")
            status, body = await request(
                session, "POST", "/v1/jobs", data=job_yaml("held", extra=GPU, rounds=50)
            )
            assert (status, body["state"]) == (201, "running"), body
            status, body = await request(session, "POST", "/v1/jobs/held/preempt")
            assert status == 202, body
            assert body["preempting"].startswith("preempted by"), body
        async with coordinator(setup) as running:
            body = await _until(
                running.session(lead),
                "/v1/jobs/held",
                # Recovery runs after the job is listed: wait until it has read its state.
                lambda b: b["state"] == "running" and b.get("preempting") is not None,
                "the job after the restart, still to be preempted",
            )
            assert (body["preempting"] or "").startswith("preempted by"), body


async def test_a_team_with_a_gpu_quota_may_not_train_on_gpus_it_does_not_state(
    tmp_path: Path,
) -> None:
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)
        _configure(setup, "teams:\n  vision: {concurrent_gpus: 4}\n")
        await _report_gpus(broker.port)
        alice = setup.fed.operator("vision--alice")
        bob = setup.fed.operator("nlp--bob")
        async with coordinator(setup) as running:
            as_alice, as_bob = running.session(alice), running.session(bob)
            await _until(as_alice, "/v1/regions", _gpus_known, "GPU capacity")
            # No needs, or CPU slots only: it would train on 16 GPUs its quota never sees.
            for name, extra in (("bare", ""), ("cpu", "needs: {cpu_slots: 1}\n")):
                status, body = await request(
                    as_alice, "POST", "/v1/jobs", data=job_yaml(name, extra=extra)
                )
                assert (status, body["error"]) == (403, "forbidden"), body
                assert body["message"].startswith(
                    "team vision has a GPU quota and this job states no GPUs in eu-west (8 "
                    "GPUs), us-east (8 GPUs)"
                ), body
            # A team without a GPU quota is not counted: its job starts as before.
            status, body = await request(as_bob, "POST", "/v1/jobs", data=job_yaml("free"))
            assert (status, body["state"]) == (201, "running"), body
            # Joining a region whose GPUs the job does not state is refused alike.
            one_region = job_yaml(
                "grow",
                extra=(
                    "needs: {cpu_slots: 1}\nregion_needs: {eu-west: {gpus: 1}}\nmax_regions: 2\n"
                ),
                rounds=50,
            ).replace("  us-east: [us-public-domain-books]\n", "")
            status, body = await request(as_alice, "POST", "/v1/jobs", data=one_region)
            assert status == 201, body
            assert body["state"] == "running", body
            status, body = await request(
                as_alice,
                "POST",
                "/v1/jobs/grow/regions",
                json={"add": "us-east", "datasets": ["us-public-domain-books"]},
            )
            assert (status, body["error"]) == (403, "forbidden"), body
            assert "states no GPUs in us-east (8 GPUs)" in body["message"], body
            _, audit = await request(as_alice, "GET", "/v1/audit?limit=1000")
            denied = [(e["action"], e["job"]) for e in audit["entries"] if e["verdict"] == "deny"]
            assert denied == [
                ("job.submit", "bare"),
                ("job.submit", "cpu"),
                ("job.regions", "grow"),
            ]
            _, jobs = await request(as_alice, "GET", "/v1/jobs")
            assert sorted(j["job"] for j in jobs["jobs"]) == ["free", "grow"]
