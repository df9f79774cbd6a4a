"""A Hugging Face model trained across regions on each region's own files, by real
daemons (embedded broker, coordinator and two agents as processes, mutual TLS, real gloo
worker groups).

What it proves: a tiny Llama saved with ``save_pretrained`` is θ_0 bit for bit (the
coordinator reads the directory's weights); each agent's config says where its dataset's
files are (parquet in eu-west, JSON lines in us-east) and the workers tokenize them into
a cache under the agent's state directory; the regions evaluate every θ_r on their own
held-out blocks and the loss falls; every region ends holding the coordinator's θ; and
``geofed export --format hf`` writes a directory that transformers loads with no missing
or unexpected key, the published θ and the same logits as geofed's model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from geofed.data import DatasetLocation, dataset_fingerprint
from geofed.params import federated_state, load_federated_state, parameters_vector_hash
from geofed.task import load_task
from tests.support.federation import operator_cli
from tests.support.hf_models import (
    save_model,
    save_tokenizer,
    stdlib_texts,
    write_jsonl,
    write_parquet,
)
from tests.support.observe import (
    WAIT_S,
    audit_entries,
    check_same_parameters,
    observed_federation,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REGIONS = ("eu-west", "us-east")
ROUNDS = 3
INNER_STEPS = 8


def build_inputs(root: Path) -> tuple[Path, dict[str, dict[str, Any]]]:
    """The model directory (with its tokenizer) and each region's dataset location."""
    model = save_tokenizer(save_model(root / "model", "llama"))
    eu = write_parquet(root / "eu-data" / "part-0.parquet", stdlib_texts(12, skip=40))
    us = write_jsonl(root / "us-data" / "docs.jsonl", stdlib_texts(12, skip=80), field="body")
    return model, {
        "eu-west": {"path": str(eu.parent), "format": "parquet"},
        "us-east": {"path": str(us), "format": "jsonl", "text_field": "body"},
    }


async def test_a_pretrained_hf_model_trains_on_each_region_s_own_files(tmp_path: Path) -> None:
    model, located = build_inputs(tmp_path / "inputs")

    def configure(name: str, data: dict[str, Any]) -> None:
        if name == "job":
            data["task"] = {
                "spec": "geofed.tasks.hf:CausalLMTask",
                "options": {
                    "model": str(model),
                    "seq_len": 32,
                    "batch_size": 4,
                    "lr": 3e-3,
                    "val_batches": 2,
                },
            }
        region = name.removeprefix("agent-")
        if region in located:
            data["datasets"] = dict.fromkeys(data["datasets"], located[region])
            data["workers"]["count"] = 1

    async with observed_federation(
        tmp_path, regions=REGIONS, rounds=ROUNDS, inner_steps=INNER_STEPS, customize=configure
    ) as (fed, observer):
        # The coordinator holds no region's data: θ_ROUNDS, which no region trains from,
        # has no held-out loss, so the job completes without one.
        final = await fed.wait_for(
            lambda s: s.get("state") == "completed", timeout_s=WAIT_S, what="the job to complete"
        )
        check_same_parameters(
            fed, observer, ROUNDS, {region: set(range(ROUNDS)) for region in REGIONS}
        )
        status = await fed.status()
        metrics_text = await fed.metrics_text()
        lineage = await fed.get(f"/v1/jobs/{fed.job}/lineage")
        entries = await audit_entries(fed, job=fed.job, verify=True)
        out = tmp_path / "export"
        exported = await operator_cli(
            fed, "export", fed.job, "--format", "hf", "--out", str(out),
            "--destination", "storage:eu-ckpt", "--json",
        )  # fmt: skip
        assert exported.returncode == 0, exported.stderr
        summary = json.loads(exported.stdout)

    import transformers

    saved = transformers.AutoModelForCausalLM.from_pretrained(model)
    opened = {a.round: a.base_hash for a in observer.announcements if a.state == "open"}
    assert opened[0] == parameters_vector_hash(federated_state(saved))
    fingerprint = load_task("geofed.tasks.hf:CausalLMTask", {"model": str(model)}).fingerprint()
    assert {a.task_fingerprint for a in observer.announcements} == {fingerprint}
    assert final["round"] == ROUNDS
    history = {row["round"]: row["value"] for row in status["val_loss_history"]}
    assert sorted(history) == list(range(ROUNDS)), history
    assert history[ROUNDS - 1] < history[0], history
    # Every metric the task gives reaches the job's status and /metrics, not only the loss.
    newest = status["evaluation"]
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
            dataset: dataset_fingerprint(
                DatasetLocation.model_validate(located[region]).resolved(Path("/"), Path("/"))
            )
            for dataset in status["regions"][region]
        }
        for region in REGIONS
    }
    contributors = lineage["lineage"]["contributors"]
    assert {c["region"]: c["data_fingerprints"] for c in contributors} == expected
    accepted = [e for e in entries if e.action == "delta.accept"]
    assert len(accepted) == ROUNDS * len(REGIONS)
    assert all(e.details["data_fingerprints"] == expected[str(e.region)] for e in accepted)
    assert str(tmp_path) not in json.dumps([e.details for e in accepted])
    # The export: what transformers loads is θ_ROUNDS, with the same logits as geofed's model.
    assert summary["round"] == ROUNDS
    assert summary["hash_matches"] is True
    assert (summary["missing_keys"], summary["unexpected_keys"]) == ([], [])
    auto: Any = transformers.AutoModelForCausalLM
    exported_model, info = auto.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    theta = federated_state(exported_model)
    assert parameters_vector_hash(theta) == final["params_hash"]
    task = load_task("geofed.tasks.hf:CausalLMTask", {"model": str(model)})
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
    assert provenance["job"] == fed.job
    assert {p["region"] for p in provenance["provenance"]} == set(REGIONS)
