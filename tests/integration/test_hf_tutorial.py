"""docs/tutorial-hf.md runs as written, against real daemons (embedded broker, coordinator
and two agents as processes, mutual TLS, real gloo worker groups): its preparing script,
the agents' dataset sections, the job, the operator's commands and the loading script.
Only the tutorial's root directory (/srv/geofed-tutorial) is moved to a temporary one.
The two Python scripts run in this process, each as a ``__main__`` of its own; the
operator's commands and the daemons are processes.

What the run proves besides: the saved Llama is θ_0 bit for bit (the coordinator reads
the directory's weights) and every announcement carries the model directory's
fingerprint; each region trains on its own files (parquet in eu-west, JSON lines in
us-east), tokenized once under the agent's state directory, from the θ_r announced for
it, and both end holding the coordinator's θ; the regions evaluate every θ_r on their own
held-out blocks and the loss falls; every metric of the task reaches the job's status and
/metrics; each region's data is named off the region by its fingerprint only (lineage,
audit log); the export loads in transformers with no missing or unexpected key, the
published θ and the same logits as geofed's model, and a lower loss than the saved
weights on files neither region trained on.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from geofed.data import DatasetLocation, dataset_fingerprint
from geofed.params import federated_state, load_federated_state, parameters_vector_hash
from geofed.task import load_task
from tests.support.federation import operator_cli, running_federation
from tests.support.observe import ControlObserver, audit_entries, check_same_parameters

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DOC = Path(__file__).resolve().parents[2] / "docs" / "tutorial-hf.md"
ROOT = "/srv/geofed-tutorial"
REGIONS = ("eu-west", "us-east")
ROUNDS = 4
SPEC = "geofed.tasks.hf:CausalLMTask"


def blocks(root: Path) -> dict[str, str]:
    """The tutorial's marked blocks by name, its root moved to ``root``."""
    text = DOC.read_text().replace(ROOT, str(root))
    found = dict(re.findall(r"<!-- tutorial: ([\w-]+) -->\n```\w+\n(.*?)```", text, re.DOTALL))
    assert set(found) == {"prepare", "agent-eu-west", "agent-us-east", "job", "run", "load"}
    return found


def run_python(name: str, source: str, cwd: Path) -> str:
    """Run the tutorial's Python block ``name`` as written, from ``cwd``, as a script: a
    ``__main__`` namespace of its own, in this process (a fresh interpreter would spend
    seconds importing torch and transformers, which this test imports anyway); what it
    printed. An exception in it fails the test with the block's line."""
    code = compile(source, f"<tutorial: {name}>", "exec")
    printed = io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(printed):
        exec(code, {"__name__": "__main__"})
    return printed.getvalue()


async def test_the_hugging_face_tutorial_runs_as_written(tmp_path: Path) -> None:
    root = tmp_path / "tutorial"
    steps = blocks(root)
    await asyncio.to_thread(run_python, "prepare", steps["prepare"], tmp_path)
    (root / "job-hf.yaml").write_text(steps["job"])
    job = yaml.safe_load(steps["job"])
    located = {r: yaml.safe_load(steps[f"agent-{r}"])["datasets"] for r in REGIONS}

    def configure(name: str, data: dict[str, Any]) -> None:
        if name == "job":  # the harness's idea of the job: the tutorial's
            data.clear()
            data.update(job)
        region = name.removeprefix("agent-")
        if region in REGIONS:
            data["datasets"] = located[region]

    commands = [
        shlex.split(line) for line in steps["run"].splitlines() if line.startswith("geofed ")
    ]
    assert [c[1:3] for c in commands] == [
        ["job", "submit"],
        ["job", "status"],
        ["export", "hf-tutorial"],
    ]
    submit, status, export = commands
    async with (
        running_federation(tmp_path / "fed", regions=REGIONS, customize=configure) as fed,
        ControlObserver(fed.mqtt_port).running() as observer,
    ):
        assert fed.job == "hf-tutorial"
        await fed.wait_ready()
        submitted = await operator_cli(fed, *submit[1:])
        assert submitted.returncode == 0, submitted.stderr
        assert "job hf-tutorial admitted" in submitted.stdout
        # The coordinator holds no region's data: θ_ROUNDS, which no region trains from,
        # has no held-out loss, so the job completes without one.
        final = await fed.wait_for(
            lambda s: s.get("state") == "completed", timeout_s=240, what="the job to complete"
        )
        await check_same_parameters(
            fed, observer, ROUNDS, {region: set(range(ROUNDS)) for region in REGIONS}
        )
        shown = await operator_cli(fed, *status[1:])
        assert shown.returncode == 0, shown.stderr
        assert "completed" in shown.stdout
        metrics_text = await fed.metrics_text()
        lineage = await fed.get(f"/v1/jobs/{fed.job}/lineage")
        entries = await audit_entries(fed, job=fed.job, verify=True)
        exported = await operator_cli(fed, *export[1:])
        assert exported.returncode == 0, exported.stderr
        assert "transformers loads it with no missing or unexpected key" in exported.stdout

    import transformers

    model_dir = root / "models" / "tiny-llama"
    auto: Any = transformers.AutoModelForCausalLM
    saved = auto.from_pretrained(model_dir)
    opened = {a.round: a.base_hash for a in observer.announcements if a.state == "open"}
    assert opened[0] == parameters_vector_hash(federated_state(saved))
    task = load_task(SPEC, {"model": str(model_dir)})
    assert {a.task_fingerprint for a in observer.announcements} == {task.fingerprint()}

    assert final["round"] == ROUNDS
    history = {row["round"]: row["value"] for row in final["val_loss_history"]}
    assert sorted(history) == list(range(ROUNDS)), history
    assert history[ROUNDS - 1] < history[0], history
    # Every metric the task gives reaches the job's status and /metrics, not only the loss.
    newest = final["evaluation"]
    assert newest["round"] == ROUNDS - 1
    assert set(newest["metrics"]) == {"val_loss", "val_perplexity"}
    assert newest["metrics"]["val_loss"] == history[ROUNDS - 1]
    gauge = f'geofed_global_evaluation_metric{{job="{fed.job}",metric="val_perplexity"}}'
    assert gauge in metrics_text
    for region in REGIONS:
        caches = list((fed.work / "agents" / region / "datasets").glob("*/tokens-*.bin"))
        assert len(caches) == 1, (region, caches)

    # Each region's data is named off the region by its fingerprint only: in the signed
    # lineage of the last version and in the audit log of every accepted delta.
    expected = {
        region: {
            name: dataset_fingerprint(DatasetLocation.model_validate(location))
            for name, location in located[region].items()
        }
        for region in REGIONS
    }
    contributors = lineage["lineage"]["contributors"]
    assert {c["region"]: c["data_fingerprints"] for c in contributors} == expected
    accepted = [e for e in entries if e.action == "delta.accept"]
    assert len(accepted) == ROUNDS * len(REGIONS)
    assert all(e.details["data_fingerprints"] == expected[str(e.region)] for e in accepted)
    assert str(tmp_path) not in json.dumps([e.details for e in accepted])

    # The export is θ_ROUNDS, with the same logits as geofed's model of it.
    out = root / "export"
    exported_model, info = auto.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    theta = federated_state(exported_model)
    assert parameters_vector_hash(theta) == final["params_hash"]
    ours = task.build_model(seed=0)
    load_federated_state(ours, theta)
    tokens = transformers.AutoTokenizer.from_pretrained(out)(
        ["def main():\n    return 0\n"], return_tensors="pt"
    )["input_ids"]
    ours.eval()
    exported_model.eval()
    with torch.no_grad():
        assert torch.equal(ours(input_ids=tokens).logits, exported_model(input_ids=tokens).logits)
    provenance = json.loads((out / "geofed_export.json").read_text())
    assert provenance["job"] == "hf-tutorial"
    assert {p["region"] for p in provenance["provenance"]} == set(REGIONS)

    # The held-out loss through transformers: the saved weights, then the export.
    # In a thread: the test's event loop serves the broker meanwhile.
    printed = await asyncio.to_thread(run_python, "load", steps["load"], tmp_path)
    print(printed)
    shown_losses = re.findall(
        r"^(\S+): held-out loss (\d+\.\d+) \(0 missing, 0 unexpected keys\)$",
        printed,
        re.MULTILINE,
    )
    assert [name for name, _ in shown_losses] == ["models/tiny-llama", "export"], printed
    before, after = (float(loss) for _, loss in shown_losses)
    assert after < before, printed
