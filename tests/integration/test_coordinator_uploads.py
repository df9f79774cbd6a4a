"""Delta uploads refused over real TLS: each answer has its code and changes nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from geofed.artifact_bundle import pack_bundle
from geofed.codec import EncodedStream
from geofed.codec_params import CodecParams
from geofed.control.broker import EmbeddedBroker
from tests.support.coordinator import (
    Announcements,
    FakeRegion,
    Running,
    coordinator,
    job_yaml,
    metric_value,
    request,
    write_setup,
)

pytestmark = pytest.mark.integration


async def _job_open(running: Running, announcements: Announcements) -> str:
    status, body = await request(
        running.session(running.setup.operator), "POST", "/v1/jobs", data=job_yaml()
    )
    assert status == 201, body
    return (await announcements.until(round=0, state="open")).base_hash


async def _upload_opened(
    running: Running, announcements: Announcements
) -> tuple[FakeRegion, bytes, EncodedStream, str]:
    """Job tiny open, and eu-west's upload of its round-0 delta opened (nothing received)."""
    base = await _job_open(running, announcements)
    eu = running.region("eu-west")
    manifest, stream = eu.delta("tiny", 0, base, seed=1)
    path = eu.path("tiny", 0)
    status, body = await request(eu.session, "PUT", path + "/manifest", data=manifest)
    assert (status, body["state"], body["received"]) == (200, "open", []), body
    assert body["chunks"] == len(list(stream.frames()))
    return eu, manifest, stream, path


async def _audit_actions(running: Running) -> list[tuple[str, str | None, str]]:
    status, body = await request(
        running.session(running.setup.observer), "GET", "/v1/audit?limit=1000&job=tiny"
    )
    assert status == 200
    return [(e["action"], e["region"], e["details"].get("code", "")) for e in body["entries"]]


async def test_refused_uploads_change_nothing(tmp_path: Path) -> None:
    async with EmbeddedBroker() as broker, Announcements(broker.port) as announcements:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            base = await _job_open(running, announcements)
            eu, us = running.region("eu-west"), running.region("us-east")
            manifest, stream = eu.delta("tiny", 0, base, seed=1)

            # us-east's certificate may not upload eu-west's delta, in either form.
            status, body = await request(
                us.session, "PUT", eu.path("tiny", 0) + "/manifest", data=manifest
            )
            assert (status, body["error"]) == (403, "forbidden"), body
            assert "region/eu-west" in body["message"]
            bundle = pack_bundle(manifest, stream.frames())
            status, body = await request(us.session, "PUT", eu.path("tiny", 0), data=bundle)
            assert (status, body["error"]) == (403, "forbidden")
            # At its own URL, eu-west's signed delta is not us-east's to send.
            status, body = await us.single_shot("tiny", 0, manifest, stream)
            assert (status, body["error"]) == (403, "producer_mismatch")
            # An observer may not upload; ap-south is not in the job, which answers to it
            # as a job that does not exist.
            observer = running.session(setup.observer)
            status, body = await request(
                observer, "PUT", eu.path("tiny", 0) + "/manifest", data=manifest
            )
            assert (status, body["error"]) == (403, "forbidden")
            ap = running.region("ap-south")
            status, body = await request(
                ap.session, "PUT", ap.path("tiny", 0) + "/manifest", data=manifest
            )
            assert (status, body) == (404, {"error": "not_found", "message": "no job tiny"})
            # Wrong base, wrong codec, wrong round, tampered signature.
            stale, _ = eu.delta("tiny", 0, "cd" * 32, seed=1)
            status, body = await request(
                eu.session, "PUT", eu.path("tiny", 0) + "/manifest", data=stale
            )
            assert (status, body["error"]) == (409, "base_mismatch")
            int4, _ = eu.delta(
                "tiny", 0, base, seed=1, codec=CodecParams(scheme="int4", block_size=32)
            )
            status, body = await request(
                eu.session, "PUT", eu.path("tiny", 0) + "/manifest", data=int4
            )
            assert (status, body["error"]) == (400, "codec_mismatch")
            status, body = await request(
                eu.session, "PUT", eu.path("tiny", 1) + "/manifest", data=manifest
            )
            assert (status, body["error"]) == (409, "wrong_round")
            tampered = manifest.replace(b'"tokens":100', b'"tokens":900')
            status, body = await request(
                eu.session, "PUT", eu.path("tiny", 0) + "/manifest", data=tampered
            )
            assert (status, body["error"]) == (403, "bad_signature")
            status, body = await request(
                eu.session, "PUT", eu.path("tiny", 0) + "/manifest", data=b"{"
            )
            assert (status, body["error"]) == (400, "malformed_manifest")

            status, job = await request(observer, "GET", "/v1/jobs/tiny")
            assert job["current"]["delivered"] == []
            # Revoked while the coordinator runs: refused from the next request on.
            setup.fed.revoke(setup.regions["ap-south"])
            status, body = await request(
                ap.session, "PUT", ap.path("tiny", 0) + "/manifest", data=manifest
            )
            assert (status, body["error"]) == (403, "revoked")
            status, body = await request(eu.session, "POST", eu.path("tiny", 0) + "/commit")
            assert (status, body["error"]) == (404, "not_found")
            rejected = 'geofed_deltas_rejected_total{code="forbidden"}'
            assert await metric_value(running, observer, rejected) == 3.0
            actions = await _audit_actions(running)
            assert ("delta.reject", "eu-west", "forbidden") in actions
            assert ("delta.reject", "eu-west", "bad_signature") in actions
            assert not [a for a in actions if a[0] == "delta.accept"]


async def test_a_tampered_frame_is_refused_and_the_upload_resumes(tmp_path: Path) -> None:
    async with EmbeddedBroker() as broker, Announcements(broker.port) as announcements:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            eu, manifest, stream, path = await _upload_opened(running, announcements)
            frames = list(stream.frames())
            assert await request(eu.session, "PUT", path + "/chunks/0", data=frames[0]) == (
                200,
                {"index": 0},
            )
            flipped = bytearray(frames[1])
            flipped[-40] ^= 0xFF
            status, body = await request(eu.session, "PUT", path + "/chunks/1", data=bytes(flipped))
            assert (status, body["error"]) == (400, "corrupt_chunk")
            status, body = await request(eu.session, "PUT", path + "/chunks/99", data=frames[1])
            assert (status, body["error"]) == (400, "bad_chunk_index")
            status, body = await request(eu.session, "POST", path + "/commit")
            assert (status, body["error"]) == (409, "incomplete")
            assert body["missing"][0] == 1
            # Re-sending the manifest reports what is already stored, and the upload resumes.
            status, body = await request(eu.session, "PUT", path + "/manifest", data=manifest)
            assert body["received"] == [0]
            status, body = await eu.three_step("tiny", 0, manifest, stream)
            assert (status, body["state"]) == (200, "accepted"), body


async def test_a_late_delta_is_refused_after_the_deadline_closes_the_round(tmp_path: Path) -> None:
    async with EmbeddedBroker() as broker, Announcements(broker.port) as announcements:
        setup = write_setup(
            tmp_path,
            broker.port,
            timeouts="{connect_s: 0.2, heartbeat_s: 0.1, request_s: 0.3, upload_s: 0.5, "
            "download_s: 0.5, round_deadline_s: 1}",
        )
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            status, body = await request(
                operator,
                "POST",
                "/v1/jobs",
                data=job_yaml(deadline=1.0, extra="min_regions: 1\n"),
            )
            assert status == 201, body
            base = (await announcements.until(round=0, state="open")).base_hash
            eu, us = running.region("eu-west"), running.region("us-east")
            status, body = await eu.single_shot("tiny", 0, *eu.delta("tiny", 0, base, seed=1))
            assert (status, body["state"]) == (200, "accepted")
            # Quorum 1 of 2: the round closes at its deadline without us-east.
            await announcements.until(round=1, state="open", timeout_s=10)
            status, body = await us.single_shot("tiny", 0, *us.delta("tiny", 0, base, seed=2))
            assert (status, body["error"]) == (409, "round_closed"), body
            observer = running.session(setup.observer)
            stragglers = 'geofed_stragglers_total{job="tiny",region="us-east"}'
            assert await metric_value(running, observer, stragglers) == 1.0


async def test_a_round_below_quorum_is_extended_then_retried_keeping_its_deltas(
    tmp_path: Path,
) -> None:
    async with EmbeddedBroker() as broker, Announcements(broker.port) as announcements:
        setup = write_setup(
            tmp_path,
            broker.port,
            timeouts="{connect_s: 0.2, heartbeat_s: 0.1, request_s: 0.3, upload_s: 0.5, "
            "download_s: 0.5, round_deadline_s: 1}",
        )
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            for name, attempts in (("retried", 3), ("doomed", 1)):
                spec = job_yaml(name, deadline=0.6, extra=f"max_round_attempts: {attempts}\n")
                status, body = await request(operator, "POST", "/v1/jobs", data=spec)
                assert status == 201, body
            eu, us = running.region("eu-west"), running.region("us-east")
            bases = {}
            for name in ("retried", "doomed"):
                bases[name] = (await announcements.until(round=0, state="open", job=name)).base_hash
                status, body = await eu.single_shot(
                    name, 0, *eu.delta(name, 0, bases[name], seed=1)
                )
                assert status == 200, body
            # Quorum 2 of 2: the deadline passes, one extension passes, the round fails.
            await announcements.until(round=0, state="cancelled", timeout_s=10, job="doomed")
            status, job = await request(operator, "GET", "/v1/jobs/doomed")
            assert job["state"] == "failed"
            assert "round 0 failed 1 time(s)" in job["error"]
            async with asyncio.timeout(10):
                while True:
                    status, job = await request(operator, "GET", "/v1/jobs/retried")
                    if job["current"]["attempt"] == 2:
                        break
                    await asyncio.sleep(0.05)
            # The retry kept eu-west's delta; us-east completes the quorum now.
            assert job["current"]["delivered"] == ["eu-west"]
            status, body = await us.single_shot(
                "retried", 0, *us.delta("retried", 0, bases["retried"], seed=2)
            )
            assert status == 200, body
            await announcements.until(round=1, state="open", timeout_s=10, job="retried")
            failed = 'geofed_rounds_failed_total{job="retried"}'
            assert await metric_value(running, operator, failed) >= 1.0


async def test_an_upload_whose_spooled_stream_is_lost_is_sent_again_whole(
    tmp_path: Path,
) -> None:
    async with EmbeddedBroker() as broker, Announcements(broker.port) as announcements:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            eu, manifest, stream, path = await _upload_opened(running, announcements)
            frames = list(stream.frames())
            assert len(frames) >= 3
            status, body = await request(eu.session, "PUT", f"{path}/chunks/0", data=frames[0])
            assert status == 200, body

            # The spooled stream is lost (a replaced disk, a hand's rm) while frame 0 is
            # recorded as received.
            spool = setup.root / "state" / "spool" / "tiny" / "0" / "eu-west"
            [lost] = spool.glob("*/stream")
            lost.unlink()
            status, body = await request(eu.session, "PUT", f"{path}/chunks/1", data=frames[1])
            assert (status, body["error"]) == (404, "not_found"), body
            assert "lost its spooled stream: PUT its manifest again" in body["message"]
            # Offered again, no frame counts as received any more: all of them go again.
            status, body = await request(eu.session, "PUT", path + "/manifest", data=manifest)
            assert (status, body["received"]) == (200, []), body
            status, body = await eu.three_step("tiny", 0, manifest, stream)
            assert (status, body["state"]) == (200, "accepted"), body
            assert not list(spool.glob("*/stream"))  # it became the delta's blob
