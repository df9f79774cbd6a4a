"""Job admission, restart, pause/resume/cancel and identity modes, over real sockets."""

from __future__ import annotations

from pathlib import Path

import pytest

from geofed.control.broker import EmbeddedBroker
from tests.support.coordinator import (
    Announcements,
    coordinator,
    job_yaml,
    metric_value,
    request,
    write_setup,
)

pytestmark = pytest.mark.integration

PERSONAL_DATA_IN_THE_US = """\
job: leaky
task: {spec: "tests.support.tiny_task:TinyTask"}
regions:
  eu-west: [eu-support-chats]
  us-east: [us-public-domain-books]
rounds: 1
inner_steps: 1
deadline: {initial_s: 30, min_s: 10, max_s: 60}
checkpoint_storage: [us-ckpt]
"""


async def test_a_job_a_region_policy_forbids_is_refused_naming_the_rule(tmp_path: Path) -> None:
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            status, body = await request(operator, "POST", "/v1/jobs", data=PERSONAL_DATA_IN_THE_US)
            assert (status, body["error"]) == (403, "policy_denied"), body
            assert "eu-west:exports.global_checkpoint[1]" in body["message"]
            assert "stored in the EU only" in body["message"]
            assert body["denials"][0]["origin"].endswith("eu-west.yaml:77")
            status, body = await request(operator, "GET", "/v1/jobs/leaky")
            assert (status, body["error"]) == (404, "not_found")
            status, audit = await request(operator, "GET", "/v1/audit?job=leaky")
            assert [(e["action"], e["verdict"]) for e in audit["entries"]] == [
                ("job.admit", "deny")
            ]
            # A malformed spec names the line and key.
            status, body = await request(
                operator, "POST", "/v1/jobs", data=job_yaml().replace("rounds: 3", "rounds: 0")
            )
            assert (status, body["error"]) == (400, "bad_request")
            assert (
                "request:8: rounds: Input should be greater than or equal to 1" in body["message"]
            )
            # Observers read but do not submit; regions do neither.
            observer = running.session(setup.observer)
            status, body = await request(observer, "POST", "/v1/jobs", data=job_yaml())
            assert (status, body["error"]) == (403, "forbidden")
            region = running.region("eu-west")
            status, body = await request(region.session, "GET", "/v1/audit")
            assert (status, body["error"]) == (403, "forbidden")


async def test_a_restart_mid_round_keeps_the_accepted_delta_and_applies_the_round_once(
    tmp_path: Path,
) -> None:
    async with EmbeddedBroker() as broker, Announcements(broker.port) as announcements:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            status, body = await request(operator, "POST", "/v1/jobs", data=job_yaml(rounds=2))
            assert status == 201, body
            base = (await announcements.until(round=0, state="open")).base_hash
            eu = running.region("eu-west")
            spooled = eu.delta("tiny", 0, base, seed=1)
            status, receipt = await eu.three_step("tiny", 0, *spooled)
            assert (status, receipt["state"]) == (200, "accepted")

        async with coordinator(setup) as running:
            observer = running.session(setup.observer)
            reannounced = await announcements.until(round=0, state="open")
            assert reannounced.base_hash == base
            status, job = await request(observer, "GET", "/v1/jobs/tiny")
            assert job["current"]["delivered"] == ["eu-west"]
            eu, us = running.region("eu-west"), running.region("us-east")
            # The region retrying its spooled delta after the restart gets its receipt back;
            # a different delta for the same round is refused.
            assert await eu.three_step("tiny", 0, *spooled) == (200, receipt)
            status, body = await eu.three_step("tiny", 0, *eu.delta("tiny", 0, base, seed=9))
            assert (status, body["error"]) == (409, "already_accepted")
            status, body = await us.single_shot("tiny", 0, *us.delta("tiny", 0, base, seed=2))
            assert (status, body["state"]) == (200, "accepted"), body
            second = await announcements.until(round=1, state="open")
            for region, seed in ((eu, 3), (us, 4)):
                status, body = await region.single_shot(
                    "tiny", 1, *region.delta("tiny", 1, second.base_hash, seed=seed)
                )
                assert status == 200, body
            done = await announcements.until(round=2, state="done")
            _, resynced, version = await us.download_params("tiny")
            assert (version, resynced) == (2, done.base_hash)
            status, job = await request(observer, "GET", "/v1/jobs/tiny")
            assert (job["state"], job["round"]) == ("completed", 2)
            completed = 'geofed_rounds_completed_total{job="tiny"}'
            assert await metric_value(running, observer, completed) == 2.0
            status, audit = await request(observer, "GET", "/v1/audit?limit=1000&verify=1")
            assert audit["verify"]["ok"]
            published = [e["round"] for e in audit["entries"] if e["action"] == "round.publish"]
            assert published == [0, 1]


async def test_operators_pause_resume_and_cancel_a_job(tmp_path: Path) -> None:
    async with EmbeddedBroker() as broker, Announcements(broker.port) as announcements:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            status, body = await request(operator, "POST", "/v1/jobs", data=job_yaml())
            assert status == 201, body
            base = (await announcements.until(round=0, state="open")).base_hash
            eu = running.region("eu-west")
            status, body = await eu.single_shot("tiny", 0, *eu.delta("tiny", 0, base, seed=1))
            assert status == 200, body

            assert await request(operator, "POST", "/v1/jobs/tiny/pause") == (
                200,
                {"job": "tiny", "state": "paused"},
            )
            await announcements.until(round=0, state="paused")
            us = running.region("us-east")
            status, body = await us.single_shot("tiny", 0, *us.delta("tiny", 0, base, seed=2))
            assert (status, body["error"]) == (409, "round_closed")
            status, body = await request(operator, "POST", "/v1/jobs/tiny/pause")
            assert (status, body["error"]) == (409, "invalid_state")

            status, body = await request(operator, "POST", "/v1/jobs/tiny/resume")
            assert (status, body["state"]) == (200, "running")
            await announcements.until(round=0, state="open")
            status, job = await request(operator, "GET", "/v1/jobs/tiny")
            assert (job["current"]["attempt"], job["current"]["delivered"]) == (2, ["eu-west"])

            status, body = await request(operator, "POST", "/v1/jobs/tiny/cancel")
            assert (status, body["state"]) == (200, "cancelled")
            await announcements.until(round=0, state="cancelled")
            status, body = await request(operator, "POST", "/v1/jobs/tiny/resume")
            assert (status, body["error"]) == (409, "invalid_state")
            observer = running.session(setup.observer)
            status, body = await request(observer, "POST", "/v1/jobs/tiny/pause")
            assert (status, body["error"]) == (403, "forbidden")
            status, audit = await request(operator, "GET", "/v1/audit?job=tiny&limit=1000")
            actions = [e["action"] for e in audit["entries"]]
            assert {"job.pause", "job.resume", "job.cancel"} <= set(actions)


async def test_identity_header_only_in_insecure_loopback_mode(tmp_path: Path) -> None:
    async with EmbeddedBroker() as broker:
        secure = write_setup(tmp_path / "tls", broker.port)
        async with coordinator(secure) as running:
            operator = running.session(secure.operator)
            async with operator.get(
                "/v1/jobs", headers={"X-Geofed-Identity": "spiffe://acme/operator/ops"}
            ) as response:
                assert response.status == 403
                assert "insecure loopback" in (await response.json())["message"]
            assert (await request(operator, "GET", "/healthz")) == (200, {"status": "ok"})

        insecure = write_setup(tmp_path / "plain", broker.port, insecure=True)
        async with coordinator(insecure) as running:
            operator = running.session(insecure.operator)
            status, body = await request(operator, "POST", "/v1/jobs", data=job_yaml())
            assert status == 201, body
            status, body = await request(operator, "GET", "/readyz")
            assert (status, body["ready"]) == (200, True), body
            anonymous = running.session(insecure.operator)
            anonymous.headers.pop("X-Geofed-Identity")
            status, body = await request(anonymous, "GET", "/v1/jobs")
            assert (status, body["error"]) == (403, "forbidden")
