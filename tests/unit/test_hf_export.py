"""geofed.tasks.hf_export: θ written as a Hugging Face model directory that transformers
loads with no missing or unexpected key and the same logits as geofed's model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from coordinator.jobs.initial_build import initial_parameters
from geofed.params import federated_state, load_federated_state, parameters_vector_hash
from geofed.task import load_task
from geofed.tasks.hf_export import EXPORT_FILE, write_hf_export
from geofed.tasks.hf_model import HfModelError
from geofed_cli.export import hf_sources, shard_size
from geofed_cli.jobs import UsageError
from tests.support.hf_models import ARCHITECTURES, save_model, save_tokenizer

SPEC = "geofed.tasks.hf:CausalLMTask"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    made = {kind: save_model(root / kind, kind) for kind in ARCHITECTURES}
    save_tokenizer(made["llama"])
    return made


def trained(model_dir: Path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """geofed's model of ``model_dir`` and a θ unlike its saved weights."""
    task = load_task("geofed.tasks.hf:CausalLMTask", {"model": str(model_dir)})
    model = task.build_model(seed=0)
    generator = torch.Generator().manual_seed(5)
    theta = {
        name: t + 0.01 * torch.randn(t.shape, generator=generator)
        for name, t in federated_state(model).items()
    }
    # A tied head is the embedding: θ carries the same values under both names.
    if "lm_head.weight" in theta and "transformer.wte.weight" in theta:
        theta["lm_head.weight"] = theta["transformer.wte.weight"]
    load_federated_state(model, theta)
    return model, theta


def assert_loads_with_the_same_logits(out: Path, model: Any, *, seed: int) -> None:
    """transformers loads the export at ``out`` with no missing or unexpected key, and it
    gives ``model``'s logits on random tokens."""
    import transformers

    auto: Any = transformers.AutoModelForCausalLM
    loaded, info = auto.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    tokens = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(seed))
    model.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, loaded(input_ids=tokens).logits)


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_transformers_loads_the_export_with_the_same_logits(
    models: dict[str, Path], kind: str, tmp_path: Path
) -> None:
    model, theta = trained(models[kind])
    out = tmp_path / "export"
    written = write_hf_export(
        out,
        theta,
        model_dir=models[kind],
        tokenizer_dir=models[kind] if kind == "llama" else None,
        metadata={"job": "llm", "round": "3", "chain": json.dumps([{"round": 3}])},
        params_hash=parameters_vector_hash(theta),
    )
    assert written.hash_matches is True
    assert "config.json" in written.files
    assert "model.safetensors" in written.files
    assert ("tokenizer.json" in written.files) == (kind == "llama")
    # Each architecture can generate: its generation settings are the directory's.
    assert "generation_config.json" in written.files
    source = json.loads((models[kind] / "generation_config.json").read_text())
    assert json.loads((out / "generation_config.json").read_text()) == source
    assert json.loads((out / EXPORT_FILE).read_text()) == {
        "job": "llm",
        "round": 3,
        "chain": [{"round": 3}],
    }
    assert_loads_with_the_same_logits(out, model, seed=1)
    assert not list(tmp_path.glob(".export.*")), "the staging directory is left behind"


def test_a_bf16_export_loads_and_a_big_model_is_sharded(
    models: dict[str, Path], tmp_path: Path
) -> None:
    import transformers

    _, theta = trained(models["qwen2"])
    written = write_hf_export(
        tmp_path / "bf16",
        theta,
        model_dir=models["qwen2"],
        tokenizer_dir=None,
        metadata={},
        params_hash=parameters_vector_hash(theta),
        dtype="bfloat16",
        max_shard_size="100KB",
    )
    assert written.hash_matches is None
    assert "model.safetensors.index.json" in written.files
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(loaded.state_dict()[name].float(), theta[name].bfloat16().float())


def test_theta_of_another_model_or_a_used_directory_is_refused(
    models: dict[str, Path], tmp_path: Path
) -> None:
    _, theta = trained(models["gpt2"])
    with pytest.raises(HfModelError, match="θ is not the model of"):
        write_hf_export(
            tmp_path / "x",
            theta,
            model_dir=models["llama"],
            tokenizer_dir=None,
            metadata={},
            params_hash=parameters_vector_hash(theta),
        )
    assert not (tmp_path / "x").exists()
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    with pytest.raises(HfModelError, match="exists and is not an empty directory"):
        write_hf_export(
            used,
            theta,
            model_dir=models["gpt2"],
            tokenizer_dir=None,
            metadata={},
            params_hash=parameters_vector_hash(theta),
        )
    assert (used / "keep.txt").read_text() == "mine"
    # A θ that is not the published one is caught when loaded back.
    with pytest.raises(HfModelError, match="not the published θ"):
        write_hf_export(
            tmp_path / "y",
            theta,
            model_dir=models["gpt2"],
            tokenizer_dir=None,
            metadata={},
            params_hash="0" * 64,
        )
    assert not (tmp_path / "y").exists()


def test_a_float32_export_above_the_max_shard_size_is_shards_with_an_index(
    models: dict[str, Path], tmp_path: Path
) -> None:

    model, theta = trained(models["llama"])
    out = tmp_path / "sharded"
    written = write_hf_export(
        out,
        theta,
        model_dir=models["llama"],
        tokenizer_dir=None,
        metadata={},
        params_hash=parameters_vector_hash(theta),
        max_shard_size=shard_size("100KB"),
    )
    assert written.hash_matches is True
    assert "model.safetensors" not in written.files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert all(name in written.files for name in shards)
    assert all((out / name).stat().st_size <= 100_000 for name in shards)
    assert_loads_with_the_same_logits(out, model, seed=2)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_0_of_a_pretrained_start_exports_as_the_source_weights_bit_for_bit(
    models: dict[str, Path], kind: str, dtype: Any, tmp_path: Path
) -> None:
    import transformers

    source = models[kind]
    if dtype == "bfloat16":
        source = tmp_path / "bf16-source"
        widened: Any = transformers.AutoModelForCausalLM.from_pretrained(models[kind])
        widened.to(torch.bfloat16).save_pretrained(source)
    # θ_0 as the coordinator builds it: float32 (bf16 widens exactly).
    theta = initial_parameters(load_task(SPEC, {"model": str(source)}), seed=0)
    assert all(t.dtype == torch.float32 for t in theta.values())
    out = tmp_path / "round-0"
    write_hf_export(
        out,
        theta,
        model_dir=source,
        tokenizer_dir=None,
        metadata={},
        params_hash=parameters_vector_hash(theta),
        dtype=dtype,
    )
    expected = load_file(source / "model.safetensors")
    exported = load_file(out / "model.safetensors")
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        assert exported[name].dtype == tensor.dtype == getattr(torch, dtype), name
        assert torch.equal(exported[name], tensor), name


def test_the_export_saves_the_tokenizer_the_task_names(
    models: dict[str, Path], tmp_path: Path
) -> None:
    import transformers

    tokenizer = save_tokenizer(tmp_path / "tokenizer")
    gpt2, llama = models["gpt2"], models["llama"]
    named = {"spec": SPEC, "options": {"model": str(gpt2), "tokenizer": str(tokenizer)}}
    assert hf_sources(named, None) == (gpt2, tokenizer)
    # The task's tokenizer wins over one the model directory holds.
    options = {"model": str(llama), "tokenizer": str(tokenizer)}
    assert hf_sources({"spec": SPEC, "options": options}, None) == (llama, tokenizer)
    # Without the option: the model directory's tokenizer, when it has one.
    assert hf_sources({"spec": SPEC, "options": {"model": str(llama)}}, None) == (llama, llama)
    assert hf_sources({"spec": SPEC, "options": {"model": str(gpt2)}}, None) == (gpt2, None)
    # --hf-model names the directory to export as, with its own tokenizer.
    assert hf_sources(named, llama) == (llama, llama)
    # --hf-tokenizer names the tokenizer, whatever the model directory (--store has no task).
    assert hf_sources(None, llama, tokenizer) == (llama, tokenizer)
    assert hf_sources(named, None, tokenizer) == (gpt2, tokenizer)
    with pytest.raises(UsageError, match=r"no tokenizer\.json"):
        hf_sources(named, None, gpt2)
    model_dir, tokenizer_dir = hf_sources(named, None)
    _, theta = trained(model_dir)
    out = tmp_path / "export"
    written = write_hf_export(
        out,
        theta,
        model_dir=model_dir,
        tokenizer_dir=tokenizer_dir,
        metadata={},
        params_hash=parameters_vector_hash(theta),
    )
    assert "tokenizer.json" in written.files
    saved = transformers.AutoTokenizer.from_pretrained(out)
    text = "def federated(x):\n    return x"
    expected = transformers.AutoTokenizer.from_pretrained(tokenizer)
    assert saved(text)["input_ids"] == expected(text)["input_ids"]
    assert saved.eos_token == "<eos>"
