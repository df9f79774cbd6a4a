"""Writing a rebuilt θ as a Hugging Face model directory, for ``geofed export --format hf``.

θ's names are the model's own ``state_dict`` names (the task trains the Hugging Face
module itself), so the export builds the architecture from the original directory's
``config.json`` on the meta device, allocates it, loads θ strictly, and lets
``save_pretrained`` write ``config.json``, ``generation_config.json`` and the weights
(``model.safetensors``, or shards with ``model.safetensors.index.json`` above
``max_shard_size``), tied weights stored once as transformers expects. The tokenizer is
saved beside them, and geofed's provenance and lineage in ``geofed_export.json``. The
directory is written under a temporary name and renamed into place once
``from_pretrained`` loaded it back with no missing or unexpected key; at float32 the
loaded parameters' hash must also be the published one.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from geofed.params import (
    federated_state,
    load_federated_state,
    parameters_vector_hash,
    shapes_mismatch,
)
from geofed.tasks.hf_model import (
    HfModelError,
    fill_rotary_buffers,
    load_config,
    transformers_module,
)

__all__ = ["DEFAULT_SHARD_SIZE", "EXPORT_FILE", "HfExport", "write_hf_export"]

#: geofed's provenance and lineage of the export, beside the model's files.
EXPORT_FILE = "geofed_export.json"
ExportDtype = Literal["float32", "bfloat16", "float16"]
#: The largest weights file before the weights are sharded (transformers' default).
DEFAULT_SHARD_SIZE = "5GB"


@dataclass(frozen=True, slots=True)
class HfExport:
    """What was written, and what loading it back said."""

    architecture: str
    files: tuple[str, ...]
    bytes: int
    dtype: str
    missing_keys: tuple[str, ...]
    unexpected_keys: tuple[str, ...]
    #: The loaded parameters' hash is the published one (None: not comparable, not fp32).
    hash_matches: bool | None


def write_hf_export(
    out: Path,
    params: Mapping[str, Tensor],
    *,
    model_dir: Path,
    tokenizer_dir: Path | None,
    metadata: Mapping[str, str],
    params_hash: str,
    dtype: ExportDtype = "float32",
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
) -> HfExport:
    """Write θ (``params``) as a Hugging Face model directory at ``out`` (see the module
    docstring). ``out`` must not exist, or be an empty directory. ``max_shard_size``:
    bytes, or a size as transformers reads it (``"5GB"``)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HfModelError(f"{out} exists and is not an empty directory")
    transformers = transformers_module()
    config = load_config(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _check_names(model, params, model_dir)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty unties a head that reads the embedding's weight
    fill_rotary_buffers(model)
    load_federated_state(model, params)
    if dtype != "float32":
        model.to(getattr(torch, dtype))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True, max_shard_size=max_shard_size)
        _save_generation_config(transformers, model_dir, staging)
        if tokenizer_dir is not None:
            _save_tokenizer(transformers, tokenizer_dir, staging)
        provenance = {key: _decoded(value) for key, value in metadata.items()}
        (staging / EXPORT_FILE).write_text(json.dumps(provenance, indent=2, sort_keys=True))
        matches = _loads_back(transformers, staging, params_hash if dtype == "float32" else None)
        files = tuple(sorted(p.name for p in staging.iterdir()))
        size = sum(p.stat().st_size for p in staging.iterdir() if p.is_file())
        if out.exists():
            out.rmdir()
        staging.replace(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return HfExport(type(model).__name__, files, size, dtype, (), (), matches)


def _loads_back(transformers: Any, directory: Path, params_hash: str | None) -> bool | None:
    """Load ``directory`` with ``from_pretrained``: every key must match, and the weights
    hash to ``params_hash`` when given (whether they do; None when not compared)."""
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, local_files_only=True, output_loading_info=True
    )
    missing = sorted(info.get("missing_keys", ()))
    unexpected = sorted(info.get("unexpected_keys", ()))
    if missing or unexpected:
        raise HfModelError(
            f"transformers loads the export with missing keys {missing} and unexpected "
            f"keys {unexpected}"
        )
    if params_hash is None:
        return None
    if parameters_vector_hash(federated_state(loaded)) != params_hash:
        raise HfModelError(
            f"the exported weights, loaded back, are not the published θ (parameters hash "
            f"{params_hash})"
        )
    return True


def _check_names(model: torch.nn.Module, params: Mapping[str, Tensor], model_dir: Path) -> None:
    expected = {name: tuple(t.shape) for name, t in federated_state(model).items()}
    differs = shapes_mismatch(expected, {name: tuple(t.shape) for name, t in params.items()})
    if differs is not None:
        raise HfModelError(
            f"θ is not the model of {model_dir}/config.json ({type(model).__name__}): {differs}"
        )


def _save_generation_config(transformers: Any, model_dir: Path, out: Path) -> None:
    if (model_dir / "generation_config.json").is_file():
        generation = transformers.GenerationConfig.from_pretrained(model_dir, local_files_only=True)
        generation.save_pretrained(out)


def _save_tokenizer(transformers: Any, tokenizer_dir: Path, out: Path) -> None:
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise HfModelError(f"{tokenizer_dir}: cannot load the tokenizer: {exc}") from None
    tokenizer.save_pretrained(out)


def _decoded(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value
