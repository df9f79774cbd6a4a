"""Where an export may go is granted to the operator's team, not declared by the operator.

A coordinator (real HTTPS with client certificates, SQLite, an embedded broker) whose
config grants team ``default`` one destination runs a job. Its operator asks for the
model at a jurisdiction it names itself (where its machine is, it says): refused 403
naming the team's destinations, audited, no grant made. At the granted destination the
export is decided by the residency policies as before and granted. An admin may name
any destination.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from geofed.api_paths import ApiPaths
from geofed.control.broker import EmbeddedBroker
from tests.support.coordinator import JOB, coordinator, job_yaml, request, write_setup

pytestmark = pytest.mark.integration


async def test_an_export_goes_only_to_a_destination_granted_to_the_team(tmp_path: Path) -> None:
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)
        with setup.config_path.open("a") as config:
            config.write("export_destinations: {default: [storage:eu-ckpt]}\nadmins: [lead]\n")
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            status, body = await request(operator, "POST", ApiPaths.JOBS, data=job_yaml())
            assert status == 201, body

            exports = ApiPaths.exports(JOB)
            status, body = await request(
                operator, "POST", exports, json={"destination": "jurisdiction:EU"}
            )
            assert (status, body["error"]) == (403, "forbidden"), body
            assert body["message"] == (
                "team default may not export to jurisdiction:EU (its destinations: "
                "storage:eu-ckpt; the coordinator config's export_destinations.default, "
                "which an admin sets)"
            )
            status, body = await request(
                operator, "POST", exports, json={"destination": "storage:eu-ckpt"}
            )
            assert status == 201, body
            assert body["destination"].startswith("storage:eu-ckpt"), body

            lead = running.session(setup.fed.operator("lead"))
            status, body = await request(
                lead, "POST", exports, json={"destination": "jurisdiction:EU"}
            )
            assert status == 201, body

            _, audit = await request(operator, "GET", "/v1/audit?limit=1000")
            decided = [
                (e["actor"].rsplit("/", 1)[-1], e["verdict"], e["details"].get("export") is None)
                for e in audit["entries"]
                if e["action"] == "export"
            ]
            assert decided == [
                ("ops", "deny", True),
                ("ops", "allow", False),
                ("lead", "allow", False),
            ]
            refused = next(e for e in audit["entries"] if e["action"] == "export")
            assert refused["details"]["destination"] == "jurisdiction:EU"
            assert "export_destinations.default" in refused["details"]["reason"]
