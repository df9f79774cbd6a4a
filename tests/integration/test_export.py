"""``geofed export`` and ``init_from`` against a real federation: the exported model is
the published one, and a job starts from it.

A two-region federation trains three rounds; the operator exports the final θ with the
CLI in both formats, and plain ``safetensors``/``torch`` loading into the task's
``build_model()`` reproduces the coordinator's last validation loss. A destination the
policies refuse is refused naming the rule, and every decision is in the audit log. From
a local copy of the checkpoint location, a tampered artifact is refused.

Then, on the same federation, a job starts from the last version of the first, rebuilt
from its signed chain, and one from that version's export file under the coordinator's
import_dirs; both start at exactly that θ and record what it derives from. A source
outside import_dirs, an unknown job and a version not yet published are refused at
submission, saying why.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from geofed.blobstore import FsBlobStore
from geofed.manifest import canonical_json
from geofed.params import parameters_vector_hash
from geofed.task import load_task
from tests.support.federation import FederationRun, operator_cli
from tests.support.observe import WAIT_S, ControlObserver, audit_entries, observed_federation

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
REGIONS = ("eu-west", "us-east")


def evaluate(spec: dict[str, Any], state: dict[str, torch.Tensor]) -> float:
    """The task's validation loss of ``state`` loaded into a fresh ``build_model()``."""
    task = load_task(spec["task"]["spec"], spec["task"].get("options"))
    model = task.build_model(seed=spec.get("seed"))
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return float(task.evaluate(model)["val_loss"])


def location_root(fed: FederationRun, name: str) -> Path:
    config = yaml.safe_load(fed.configs.coordinator.read_text())
    path = Path(next(s["path"] for s in config["storage"] if s["name"] == name))
    return path if path.is_absolute() else (fed.configs.coordinator.parent / path).resolve()


def derived(fed: FederationRun, name: str, init_from: dict[str, Any]) -> dict[str, Any]:
    spec = fed.job_spec()
    return {**spec, "job": name, "rounds": 1, "init_from": init_from}


async def completed(fed: FederationRun, job: str) -> dict[str, Any]:
    return await fed.wait_for(
        lambda s: s.get("state") == "completed", timeout_s=WAIT_S, what=f"{job}", job=job
    )


async def test_export_rebuilds_the_published_model_and_a_job_starts_from_it(
    tmp_path: Path,
) -> None:
    imports = tmp_path / "imports"
    imports.mkdir()

    def configure(name: str, data: dict[str, Any]) -> None:
        if name == "coordinator":
            data["import_dirs"] = [str(imports)]

    async with observed_federation(
        tmp_path, regions=REGIONS, rounds=3, inner_steps=3, customize=configure
    ) as (fed, observer):
        final = await fed.wait_completed()
        spec = fed.job_spec()
        job = fed.job
        loss = final["global_val_loss"]
        assert loss["round"] == 3

        # safetensors, to a declared storage location the policies allow.
        st_file = tmp_path / "model.safetensors"
        done = await operator_cli(
            fed, "export", job, "--out", str(st_file), "--destination", "storage:eu-ckpt",
            "--json",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        assert summary["round"] == 3
        assert summary["parameters_hash"] == final["params_hash"]
        state = load_file(st_file)
        assert parameters_vector_hash(state) == final["params_hash"]
        reproduced = evaluate(spec, state)
        assert reproduced == pytest.approx(loss["value"], rel=1e-6, abs=1e-7)
        with safe_open(st_file, "pt") as opened:
            meta = opened.metadata()
        assert meta["job"] == job
        assert meta["round"] == "3"
        assert meta["parameters_hash"] == final["params_hash"]
        assert {p["region"] for p in json.loads(meta["provenance"])} == set(REGIONS)
        chain = json.loads(meta["chain"])
        assert [(c["kind"], c["round"]) for c in chain] == [
            ("global_checkpoint", 0),
            ("global_update", 0),
            ("global_update", 1),
            ("global_update", 2),
        ]

        # The lineage of θ_3 (made by round 2), signed into the export's own chain.
        shown = await operator_cli(fed, "lineage", job, "--json")
        assert shown.returncode == 0, shown.stderr
        served = json.loads(shown.stdout)
        assert served["version"] == 3
        lineage = served["lineage"]
        assert json.loads(meta["lineage"]) == lineage
        assert lineage["round"] == 2
        assert lineage["spec_hash"] == hashlib.sha256(canonical_json(final["spec"])).hexdigest()
        accepted = {
            e.region: e.details["manifest"]
            for e in await audit_entries(fed, job=job)
            if e.action == "delta.accept" and e.round == 2
        }
        contributors = {c["region"]: c for c in lineage["contributors"]}
        assert set(contributors) == set(REGIONS)
        for region, entry in contributors.items():
            assert entry["delta_manifest"] == accepted[region]
            assert entry["software"]["torch"] == torch.__version__
            assert entry["software"]["task"] == lineage["coordinator"]["task"]
            assert entry["code_matches"] is True
        text = await operator_cli(fed, "lineage", job, "--round", "1")
        assert text.returncode == 0, text.stderr
        assert text.stdout.startswith(f"job {job} θ_1: made by round 0"), text.stdout
        assert "eu-west (EU; datasets" in text.stdout
        codec = next(line for line in text.stdout.splitlines() if line.startswith("  codec: "))
        assert "scheme int8" in codec, codec  # read as a person reads it, not a Python repr
        assert "{'" not in text.stdout, text.stdout

        # torch, to the operator's own jurisdiction (the default destination).
        pt_file = tmp_path / "model.pt"
        done = await operator_cli(
            fed, "export", job, "--out", str(pt_file), "--format", "torch",
            GEOFED_JURISDICTION="EU",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        loaded = torch.load(pt_file, weights_only=True)
        assert loaded["metadata"]["parameters_hash"] == final["params_hash"]
        assert loaded["metadata"]["destination"] == "jurisdiction:EU"
        assert evaluate(spec, loaded["state_dict"]) == pytest.approx(loss["value"], rel=1e-6)
        for name, tensor in state.items():
            assert torch.equal(tensor, loaded["state_dict"][name]), name
        print(
            f"export round trip: safetensors {st_file.stat().st_size} B, torch "
            f"{pt_file.stat().st_size} B, {summary['parameters']} parameters in "
            f"{summary['tensors']} tensors; hash {summary['parameters_hash'][:16]} equal to "
            f"the published one; val_loss {reproduced!r} vs the coordinator's {loss['value']!r}"
        )

        # An older version, rebuilt from the same chain.
        done = await operator_cli(
            fed, "export", job, "--round", "1", "--out", str(tmp_path / "r1.safetensors"),
            "--destination", "jurisdiction:EU", "--json",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        history = {e["round"]: e for e in final["val_loss_history"]}
        r1 = load_file(tmp_path / "r1.safetensors")
        if 1 in history:
            assert evaluate(spec, r1) == pytest.approx(history[1]["value"], rel=1e-6)

        # eu-west's data may not leave the EU as a whole model: refused, naming the rule.
        denied = await operator_cli(
            fed, "export", job, "--out", str(tmp_path / "us.pt"),
            "--destination", "jurisdiction:US",
        )  # fmt: skip
        assert denied.returncode == 1
        assert "policy_denied" in denied.stderr, denied.stderr
        assert "[rule " in denied.stderr, denied.stderr
        assert not (tmp_path / "us.pt").exists()

        entries = await audit_entries(fed, job=job, verify=True)
        exports = [e for e in entries if e.action == "export"]
        verdicts = [(e.verdict, e.details["destination"].split(" ")[0]) for e in exports]
        assert verdicts == [
            ("allow", "storage:eu-ckpt"),
            ("allow", "storage:export-demo"),
            ("allow", "storage:export-demo"),
            ("deny", "storage:export-demo"),
        ], verdicts
        denial = exports[-1].details
        assert denial["rule"] in denied.stderr
        assert "jurisdiction US" in denial["destination"]

        # A local copy of the checkpoint location: it exports the same model...
        copy = tmp_path / "eu-ckpt"
        shutil.copytree(location_root(fed, final["checkpoint_location"]), copy)
        local = tmp_path / "local.safetensors"
        done = await operator_cli(fed, "export", job, "--store", str(copy), "--out", str(local))
        assert done.returncode == 0, done.stderr
        assert parameters_vector_hash(load_file(local)) == final["params_hash"]

        # ...until one byte of an update is changed: refused, and nothing is written.
        index = json.loads((copy / "jobs" / job / "index.json").read_text())
        update = next(e for e in index["entries"] if e["kind"] == "update" and e["round"] == 1)
        blob = FsBlobStore(copy / "blobs").path_of(update["payload_digest"])
        blob.chmod(0o600)
        data = bytearray(blob.read_bytes())
        data[-10] ^= 0x01
        blob.write_bytes(bytes(data))
        tampered = tmp_path / "tampered.safetensors"
        refused = await operator_cli(
            fed, "export", job, "--store", str(copy), "--out", str(tampered)
        )
        assert refused.returncode == 1
        assert "refused" in refused.stderr, refused.stderr
        assert "global_update" in refused.stderr, refused.stderr
        assert not tampered.exists()

        await jobs_start_from_it(fed, observer, final, imports)

        # The exports it served left no traceback in the coordinator's log (a response
        # prepared twice would log an AssertionError for every artifact sent).
        daemon = next(c for c in fed.children.children if c.name == "coordinator")
        log = daemon.log_file.read_text(errors="replace")
        assert "Traceback" not in log, daemon.log_tail(60)


async def jobs_start_from_it(
    fed: FederationRun, observer: ControlObserver, base: dict[str, Any], imports: Path
) -> None:
    """A job from the finished job's last version, one from its export file, and the
    sources refused at submission."""
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
        "outside": {"path": str(fed.work / "pki" / "trust.yaml")},
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
    assert recorded["round"] == base["round"] == 3
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
