"""Lineage over real TLS: each published version names what made it; other task code is flagged.

A coordinator and two test regions: the regions sign their software into their deltas,
the coordinator signs the round's lineage into the update, and ``GET
/v1/jobs/{job}/lineage`` serves it. A job with ``code_mismatch: refuse`` refuses a delta
trained with other task code (or that says nothing of it); by default it is warned about
and audited once, at the region's first delta, and accepted.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from geofed.control.broker import EmbeddedBroker
from geofed.lineage import local_software
from geofed.manifest import canonical_json
from tests.support.coordinator import (
    Announcements,
    coordinator,
    job_yaml,
    request,
    write_setup,
)
from tests.support.tiny_task import SPEC

pytestmark = pytest.mark.integration


async def test_a_version_names_what_made_it_and_other_code_is_refused(tmp_path: Path) -> None:
    ours = local_software(SPEC)
    other = ours.model_copy(
        update={"task": ours.task.model_copy(update={"fingerprint": "ab" * 32})}
    )
    async with EmbeddedBroker() as broker, Announcements(broker.port) as announcements:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            observer = running.session(setup.observer)
            spec = job_yaml(extra="code_mismatch: refuse\n")
            status, body = await request(operator, "POST", "/v1/jobs", data=spec)
            assert status == 201, body
            base = (await announcements.until(round=0, state="open")).base_hash
            eu, us = running.region("eu-west"), running.region("us-east")

            # Without a fingerprint, or with another one: refused, saying why.
            manifest, stream = eu.delta("tiny", 0, base, seed=1)
            status, body = await eu.three_step("tiny", 0, manifest, stream)
            assert (status, body["error"]) == (409, "code_mismatch"), body
            assert "eu-west sent no software fingerprint" in body["message"]
            manifest, stream = us.delta("tiny", 0, base, seed=2, software=other)
            status, body = await us.three_step("tiny", 0, manifest, stream)
            assert (status, body["error"]) == (409, "code_mismatch"), body
            assert "abababababababab" in body["message"]

            # The coordinator's own code: accepted, and the round is published.
            receipts = {}
            for region, seed in ((eu, 3), (us, 4)):
                manifest, stream = region.delta("tiny", 0, base, seed=seed, software=ours)
                status, body = await region.three_step("tiny", 0, manifest, stream)
                assert (status, body["state"]) == (200, "accepted"), body
                receipts[region.name] = body["receipt"]
            await announcements.until(round=1, state="open")

            status, body = await request(observer, "GET", "/v1/jobs/tiny/lineage")
            assert status == 200, body
            assert body["version"] == 1
            assert body["signed_by"].endswith("/coordinator/main")
            lineage = body["lineage"]
            assert lineage["round"] == 0
            status, job = await request(operator, "GET", "/v1/jobs/tiny")
            assert lineage["spec_hash"] == hashlib.sha256(canonical_json(job["spec"])).hexdigest()
            assert lineage["codec"] == job["spec"]["codec"]
            assert lineage["outer_optimizer"] == job["spec"]["outer_optimizer"]
            assert lineage["coordinator"] == ours.model_dump(mode="json")
            assert [c["region"] for c in lineage["contributors"]] == ["eu-west", "us-east"]
            for entry in lineage["contributors"]:
                assert entry["delta_manifest"] == receipts[entry["region"]]["manifest_digest"]
                assert entry["tokens"] == receipts[entry["region"]]["tokens"]
                assert entry["software"] == ours.model_dump(mode="json")
                assert entry["code_matches"] is True
            assert lineage["contributors"][0]["jurisdiction"] == "EU"

            # θ_0 has no round behind it; θ_2 is not published; regions do not read lineage.
            status, body = await request(observer, "GET", "/v1/jobs/tiny/lineage?round=0")
            assert (status, body["error"]) == (404, "not_found")
            status, body = await request(observer, "GET", "/v1/jobs/tiny/lineage?round=2")
            assert (status, body["error"]) == (404, "not_found")
            status, body = await request(eu.session, "GET", "/v1/jobs/tiny/lineage")
            assert (status, body["error"]) == (403, "forbidden")

            status, audit = await request(observer, "GET", "/v1/audit?limit=1000&job=tiny")
            refused = [
                (e["region"], e["details"].get("code"))
                for e in audit["entries"]
                if e["action"] == "delta.reject"
            ]
            assert refused == [("eu-west", "code_mismatch"), ("us-east", "code_mismatch")]


async def test_other_code_is_warned_about_once_by_default(tmp_path: Path) -> None:
    ours = local_software(SPEC)
    other = ours.model_copy(
        update={"task": ours.task.model_copy(update={"fingerprint": "cd" * 32})}
    )
    async with EmbeddedBroker() as broker, Announcements(broker.port) as announcements:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            status, body = await request(operator, "POST", "/v1/jobs", data=job_yaml("warned"))
            assert status == 201, body
            base = (await announcements.until(round=0, state="open", job="warned")).base_hash
            eu, us = running.region("eu-west"), running.region("us-east")
            manifest, stream = eu.delta("warned", 0, base, seed=1, software=other)
            status, body = await eu.three_step("warned", 0, manifest, stream)
            assert (status, body["state"]) == (200, "accepted"), body
            manifest, stream = us.delta("warned", 0, base, seed=2, software=ours)
            status, body = await us.three_step("warned", 0, manifest, stream)
            assert (status, body["state"]) == (200, "accepted"), body
            next_base = (await announcements.until(round=1, state="open", job="warned")).base_hash
            manifest, stream = eu.delta("warned", 1, next_base, seed=3, software=other)
            status, body = await eu.three_step("warned", 1, manifest, stream)
            assert (status, body["state"]) == (200, "accepted"), body

            status, audit = await request(operator, "GET", "/v1/audit?limit=1000&job=warned")
            flagged = [e for e in audit["entries"] if e["action"] == "lineage.code_mismatch"]
            assert [(e["region"], e["round"], e["verdict"]) for e in flagged] == [
                ("eu-west", 0, "allow")
            ]
            assert "cdcdcdcdcdcdcdcd" in flagged[0]["details"]["reason"]
            status, body = await request(operator, "GET", "/v1/jobs/warned/lineage")
            assert status == 200, body
            matches = {c["region"]: c["code_matches"] for c in body["lineage"]["contributors"]}
            assert matches == {"eu-west": False, "us-east": True}
