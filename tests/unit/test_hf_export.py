"""geofed.tasks.hf_export: θ written as a Hugging Face model directory that transformers
loads with no missing or unexpected key and the same logits as geofed's model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from geofed.params import federated_state, load_federated_state, parameters_vector_hash
from geofed.task import load_task
from geofed.tasks.hf_export import EXPORT_FILE, write_hf_export
from geofed.tasks.hf_model import HfModelError
from tests.support.hf_models import ARCHITECTURES, save_model, save_tokenizer


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


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_transformers_loads_the_export_with_the_same_logits(
    models: dict[str, Path], kind: str, tmp_path: Path
) -> None:
    import transformers

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
    assert json.loads((out / EXPORT_FILE).read_text()) == {
        "job": "llm",
        "round": 3,
        "chain": [{"round": 3}],
    }
    auto: Any = transformers.AutoModelForCausalLM
    loaded, info = auto.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    tokens = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(1))
    model.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, loaded(input_ids=tokens).logits)
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
