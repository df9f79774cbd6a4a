"""geofed.tasks.hf:CausalLMTask on tiny Llama, Qwen2 and GPT-2 models saved on the spot:
pretrained and seeded starts, the meta-device build the workers use, the region's data
as deterministic batches, the held-out evaluation and the clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from geofed.data import DataError, DatasetLocation
from geofed.params import federated_state, load_federated_state
from geofed.task import DataShard, TaskOptionsError, load_task
from geofed.tasks.hf_model import HfModelError
from regional_agent.worker.job_state import check_fingerprint
from regional_agent.worker.model_build import build_model
from tests.support.hf_models import (
    ARCHITECTURES,
    VOCAB,
    save_model,
    save_tokenizer,
    stdlib_texts,
    write_jsonl,
    write_parquet,
    write_tokens,
)
from tests.support.tiny_task import TinyTask

SPEC = "geofed.tasks.hf:CausalLMTask"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    made = {kind: save_model(root / kind, kind) for kind in ARCHITECTURES}
    for directory in made.values():
        save_tokenizer(directory)
    return made


@pytest.fixture(scope="module")
def text_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DatasetLocation]:
    root = tmp_path_factory.mktemp("data")
    write_parquet(root / "eu" / "part-0.parquet", stdlib_texts(6, skip=40))
    write_jsonl(root / "us" / "docs.jsonl", stdlib_texts(6, skip=60), field="body")
    return {
        "eu-docs": DatasetLocation(
            path=str(root / "eu"), format="parquet", cache_dir=str(root / "cache-eu")
        ),
        "us-docs": DatasetLocation(
            path=str(root / "us"),
            format="jsonl",
            text_field="body",
            cache_dir=str(root / "cache-us"),
        ),
    }


def task_for(model: Path, **options: Any) -> Any:
    return load_task(SPEC, {"model": str(model), "seq_len": 16, "batch_size": 2, **options})


def shard(datasets: dict[str, DatasetLocation], rank: int = 0, world: int = 2) -> DataShard:
    return DataShard("eu-west", 0, 1, rank, world, seed=3, datasets=datasets)


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_a_pretrained_start_is_the_directory_s_weights_and_a_random_one_its_seed(
    models: dict[str, Path], kind: str
) -> None:
    import transformers

    saved = transformers.AutoModelForCausalLM.from_pretrained(models[kind])
    expected = federated_state(saved)
    pretrained = federated_state(task_for(models[kind]).build_model(seed=0))
    assert pretrained.keys() == expected.keys()
    assert all(torch.equal(pretrained[k], expected[k]) for k in expected)
    random_task = task_for(models[kind], init="random")
    first = federated_state(random_task.build_model(seed=1))
    again = federated_state(random_task.build_model(seed=1))
    other = federated_state(random_task.build_model(seed=2))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first)
    assert any(not torch.equal(first[k], expected[k]) for k in first)


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_the_workers_build_loads_theta_and_computes_the_same_loss(
    models: dict[str, Path], text_data: dict[str, DatasetLocation], kind: str
) -> None:
    task = task_for(models[kind])
    host = task.build_model(seed=0)
    theta = {k: v.clone() for k, v in federated_state(host).items()}
    batch = next(task.batches(shard(text_data), 0))
    with torch.no_grad():
        expected = float(task.loss(host, batch))
    built = build_model(task, 0, torch.device("cpu"))
    model = built.model
    if kind == "gpt2":
        # Its head is its embedding: to_empty would untie them, so it is built whole.
        assert built.materialize is None
        assert "one shared parameter" in built.reason
    else:
        assert built.materialize is not None, built.reason
        model.to_empty(device="cpu")
        built.materialize(model)
    load_federated_state(model, theta)
    with torch.no_grad():
        assert float(task.loss(model, batch)) == expected
    units = task.fsdp_units(model)
    layers = task.checkpoint_units(model)
    assert len(layers) == 2
    # Untied: the embedding and the head are units of their own.
    assert len(units) == (2 if kind == "gpt2" else 4)
    assert task.flops_per_token(model) > 6 * 2 * 64 * 64


def test_batches_are_a_function_of_shard_and_step(
    models: dict[str, Path], text_data: dict[str, DatasetLocation]
) -> None:
    task = task_for(models["llama"])
    stream = task.batches(shard(text_data), 0)
    first = [next(stream) for _ in range(4)]
    restarted = task_for(models["llama"]).batches(shard(text_data), 2)
    assert torch.equal(next(restarted), first[2])
    other_rank = next(task.batches(shard(text_data, rank=1), 0))
    assert not torch.equal(other_rank, first[0])
    assert first[0].shape == (2, 17)
    assert task.tokens(first[0]) == 32
    # Each document is followed by EOS (id 0 in the tokenizer) in the packed stream.
    for location in text_data.values():
        assert location.cache_dir is not None
        (cached,) = Path(location.cache_dir).glob("tokens-*.bin")
        assert int((np.fromfile(cached, dtype=np.uint16) == 0).sum()) == 6


def test_the_region_evaluates_on_its_held_out_blocks(
    models: dict[str, Path], text_data: dict[str, DatasetLocation]
) -> None:
    task = task_for(models["qwen2"], val_batches=2)
    model = task.build_model(seed=0)
    metrics = task.evaluate_region(model, shard(text_data))
    assert set(metrics) == {"val_loss", "val_perplexity"}
    assert metrics == task.evaluate_region(model, shard(text_data, rank=1))
    assert 0 < metrics["val_loss"] < 10
    # The coordinator holds no region's data: it has nothing to measure.
    assert task.evaluate(model) == {}
    assert task_for(models["qwen2"], val_batches=0).evaluate_region(model, shard(text_data)) == {}


def test_token_files_are_read_as_they_are_and_checked_against_the_vocabulary(
    models: dict[str, Path], tmp_path: Path
) -> None:
    write_tokens(tmp_path / "tokens" / "a.bin", 2000)
    located = {"toks": DatasetLocation(path=str(tmp_path / "tokens"), format="tokens")}
    task = task_for(models["llama"])
    batch = next(task.batches(shard(located), 0))
    assert int(batch.max()) < VOCAB
    write_tokens(tmp_path / "wide" / "a.bin", 2000, vocab=60000)
    wide = {"toks": DatasetLocation(path=str(tmp_path / "wide"), format="tokens")}
    with pytest.raises(DataError, match=f"outside the model's vocabulary of {VOCAB}"):
        next(task_for(models["llama"]).batches(shard(wide), 0))


def test_options_datasets_pick_some_of_the_region_s(
    models: dict[str, Path], text_data: dict[str, DatasetLocation]
) -> None:
    both = next(task_for(models["llama"]).batches(shard(text_data), 0))
    only_us = next(task_for(models["llama"], datasets=["us-docs"]).batches(shard(text_data), 0))
    assert not torch.equal(both, only_us)
    with pytest.raises(DataError, match="dataset ap-docs has no files"):
        next(task_for(models["llama"], datasets=["ap-docs"]).batches(shard(text_data), 0))
    with pytest.raises(DataError, match="gives this job no dataset files"):
        next(task_for(models["llama"]).batches(shard({}), 0))


def test_bad_options_and_directories_are_refused_clearly(
    models: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(TaskOptionsError, match="relative"):
        load_task(SPEC, {"model": "models/llama"})
    with pytest.raises(TaskOptionsError, match="layers: Extra inputs are not permitted"):
        load_task(SPEC, {"model": str(models["llama"]), "layers": 3})
    with pytest.raises(HfModelError, match=r"no config\.json"):
        load_task(SPEC, {"model": str(tmp_path)}).build_model(seed=0)
    with pytest.raises(ValidationError):
        DatasetLocation(path="/x", format="csv")  # type: ignore[arg-type]


def test_the_fingerprint_follows_the_files_that_decide_the_model(tmp_path: Path) -> None:
    model = save_tokenizer(save_model(tmp_path / "m", "llama"))
    pretrained = task_for(model)
    first = pretrained.fingerprint()
    assert len(first) == 64
    assert task_for(model).fingerprint() == first
    # A file that decides nothing changes nothing.
    (model / "README.md").write_text("notes")
    assert task_for(model).fingerprint() == first
    random_start = task_for(model, init="random").fingerprint()
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    changed = task_for(model).fingerprint()
    assert changed != first
    # A seeded start reads the config and the tokenizer, not the weights.
    assert task_for(model, init="random").fingerprint() == random_start
    config = json.loads((model / "config.json").read_text())
    config["rope_theta"] = 1234.0
    (model / "config.json").write_text(json.dumps(config))
    assert task_for(model, init="random").fingerprint() != random_start


def test_workers_refuse_a_task_whose_files_are_not_the_coordinator_s(
    models: dict[str, Path],
) -> None:
    task = task_for(models["gpt2"])
    check_fingerprint(task, None)
    check_fingerprint(task, task.fingerprint())
    with pytest.raises(ValueError, match="the task's files here are not the coordinator's"):
        check_fingerprint(task, "0" * 64)


def test_the_same_dataset_name_elsewhere_is_other_data(
    models: dict[str, Path], text_data: dict[str, DatasetLocation]
) -> None:
    task = task_for(models["llama"])
    eu = {"docs": text_data["eu-docs"]}
    us = {"docs": text_data["us-docs"]}
    model = task.build_model(seed=0)
    assert not torch.equal(next(task.batches(shard(eu), 0)), next(task.batches(shard(us), 0)))
    assert task.evaluate_region(model, shard(eu)) != task.evaluate_region(model, shard(us))


def test_a_text_dataset_is_one_document_a_file_and_trains(
    models: dict[str, Path], tmp_path: Path
) -> None:
    texts = stdlib_texts(3, skip=80)
    for index, text in enumerate(texts):
        (tmp_path / "notes" / f"{index}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "notes" / f"{index}.txt").write_text(text, encoding="utf-8")
    (tmp_path / "notes" / "skipped.py").write_text("not a text file")
    cache = tmp_path / "cache"
    located = {
        "notes": DatasetLocation(path=str(tmp_path / "notes"), format="text", cache_dir=str(cache))
    }
    task = task_for(models["llama"], lr=3e-3)
    # Each file is one document, followed by EOS, in path order.
    encoded = task.tokenizer.encode(texts)
    expected = [token for ids in encoded for token in [*ids, task.tokenizer.eos_id]]
    next(task.batches(shard(located), 0))
    (cached,) = cache.glob("tokens-*.bin")
    assert np.fromfile(cached, dtype=np.uint16).tolist() == expected
    model = task.build_model(seed=0)
    optimizer = task.build_optimizer(model.parameters())
    batches = task.batches(shard(located, world=1), 0)
    batch = next(batches)
    with torch.no_grad():
        before = float(task.loss(model, batch))
    for _ in range(5):
        optimizer.zero_grad()
        task.loss(model, batch).backward()
        optimizer.step()
    with torch.no_grad():
        assert float(task.loss(model, batch)) < before
    assert task.evaluate_region(model, shard(located))["val_loss"] > 0


def test_a_dataset_the_agent_config_names_without_files_is_refused_by_name(
    models: dict[str, Path], text_data: dict[str, DatasetLocation]
) -> None:
    # The job trains the region on eu-docs and eu-notes; the agent config gives eu-notes
    # no path. Reading the rest would train on less than the deltas' provenance says.
    unlocated = DataShard(
        "eu-west",
        0,
        1,
        0,
        1,
        seed=3,
        datasets={"eu-docs": text_data["eu-docs"]},
        datasets_without_files=("eu-notes",),
    )
    with pytest.raises(DataError) as refused:
        task_for(models["llama"]).batches(unlocated, 0)
    message = str(refused.value)
    assert "dataset eu-notes has no files in region eu-west's agent config" in message
    assert "add path: and format: under datasets: eu-notes:" in message
    with pytest.raises(DataError, match="dataset eu-notes has no files"):
        task_for(models["llama"], datasets=["eu-notes"]).batches(unlocated, 0)
    # Naming only the located one reads it, as before.
    only = task_for(models["llama"], datasets=["eu-docs"]).batches(unlocated, 0)
    assert next(only).shape == (2, 17)
    # A task with data of its own needs no files: it trains as before.
    assert next(TinyTask().batches(unlocated, 0)) is not None
