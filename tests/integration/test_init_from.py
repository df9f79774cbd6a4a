"""init_from against a real coordinator: a job starts from the last version of another,
rebuilt from its signed chain, and one from that version's export file under the
coordinator's import_dirs; both start at exactly that θ and record what it derives from.
A source outside import_dirs, an unknown job and a version not yet published are refused
at submission, saying why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.federation import FederationRun, operator_cli
from tests.support.observe import WAIT_S, observed_federation

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REGIONS = ("eu-west", "us-east")


def derived(fed: FederationRun, name: str, init_from: dict[str, Any]) -> dict[str, Any]:
    spec = fed.job_spec()
    return {**spec, "job": name, "rounds": 1, "init_from": init_from}


async def completed(fed: FederationRun, job: str) -> dict[str, Any]:
    return await fed.wait_for(
        lambda s: s.get("state") == "completed", timeout_s=WAIT_S, what=f"{job}", job=job
    )


async def test_a_job_starts_from_another_job_s_version_or_its_export(tmp_path: Path) -> None:
    imports = tmp_path / "imports"
    imports.mkdir()

    def configure(name: str, data: dict[str, Any]) -> None:
        if name == "coordinator":
            data["import_dirs"] = [str(imports)]

    async with observed_federation(
        tmp_path, regions=REGIONS, rounds=2, inner_steps=3, customize=configure
    ) as (fed, observer):
        base = await fed.wait_completed(timeout_s=WAIT_S)
        exported = await operator_cli(
            fed, "export", fed.job, "--out", str(imports / "base.safetensors"),
            "--destination", "storage:eu-ckpt",
        )  # fmt: skip
        assert exported.returncode == 0, exported.stderr

        status, body = await fed.submit(derived(fed, "from-job", {"job": fed.job}))
        assert status == 201, body
        path = {"path": str(imports / "base.safetensors")}
        status, body = await fed.submit(derived(fed, "from-file", path))
        assert status == 201, body
        refusals: dict[str, dict[str, Any]] = {
            "outside": {"path": str(tmp_path / "pki" / "trust.yaml")},
            "unknown": {"job": "no-such-job"},
            "future": {"job": fed.job, "round": 9},
        }
        answers = {}
        for name, source in refusals.items():
            answers[name] = await fed.submit(derived(fed, name, source))
        from_job = await completed(fed, "from-job")
        from_file = await completed(fed, "from-file")
        spec = (await fed.status("from-job"))["spec"]

    opened = {(a.job, a.round): a.base_hash for a in observer.announcements if a.state == "open"}
    assert opened[("from-job", 0)] == base["params_hash"]
    assert opened[("from-file", 0)] == base["params_hash"]
    assert from_job["round"] == from_file["round"] == 1
    recorded = spec["init_from"]
    assert recorded["round"] == 2
    assert recorded["params_hash"] == base["params_hash"]
    assert recorded["location"] == "eu-ckpt"
    assert set(recorded["provenance"]) == set(REGIONS)
    messages = {name: (status, body["message"]) for name, (status, body) in answers.items()}
    assert messages["outside"][0] == 400
    assert "is not under the config's import_dirs" in messages["outside"][1]
    assert messages["unknown"] == (
        400,
        "job unknown: init_from: job no-such-job is not a job of this coordinator",
    )
    assert messages["future"][0] == 400
    assert "θ_9 of job" in messages["future"][1]
