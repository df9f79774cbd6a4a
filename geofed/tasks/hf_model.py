"""A Hugging Face causal language model from a local directory, as a task builds it.

The directory is what ``save_pretrained`` writes: ``config.json`` and the weights
(``model.safetensors``, or shards with ``model.safetensors.index.json``). Nothing is
downloaded: every load is ``local_files_only``. ``transformers`` is imported on first
use, so a process that never builds such a model does not pay for it, and one without
the ``hf`` extra is told how to get it.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from geofed.params import unwrap_model

__all__ = [
    "HfModelError",
    "build_causal_lm",
    "decoder_layers",
    "directory_fingerprint",
    "fill_rotary_buffers",
    "flops_per_token",
    "load_config",
    "transformers_module",
]


class HfModelError(ValueError):
    """A model directory cannot be used; the message names it and what is wrong."""


def transformers_module() -> ModuleType:
    """``transformers``, or an error saying how to install it."""
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as exc:
        raise HfModelError(
            f"Hugging Face models need the hf extra (pip install 'geofed[hf]'): {exc}"
        ) from None
    # Progress bars would fill the workers' logs with carriage returns.
    transformers.utils.logging.disable_progress_bar()
    return transformers


def load_config(model_dir: Path) -> Any:
    """The model's ``PretrainedConfig`` from ``model_dir/config.json``."""
    if not (model_dir / "config.json").is_file():
        raise HfModelError(f"{model_dir} is not a Hugging Face model directory: no config.json")
    transformers = transformers_module()
    try:
        return transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise HfModelError(f"{model_dir}/config.json: {exc}") from None


def build_causal_lm(
    model_dir: Path, config: Any, *, pretrained: bool, seed: int, attn_implementation: str
) -> nn.Module:
    """The model of ``config``: the directory's weights when ``pretrained``, else seeded.

    Under the ``meta`` device (the region's workers build there and load θ into their
    shards) only the architecture is made: θ replaces every weight anyway. The weights
    are float32 whatever the directory stores (bf16 widens exactly). The caller's RNG is
    left untouched.
    """
    transformers = transformers_module()
    on_meta = torch.get_default_device().type == "meta"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if pretrained and not on_meta:
            try:
                model, info = transformers.AutoModelForCausalLM.from_pretrained(
                    model_dir,
                    config=config,
                    dtype=torch.float32,
                    attn_implementation=attn_implementation,
                    local_files_only=True,
                    output_loading_info=True,
                )
            except (OSError, ValueError) as exc:
                raise HfModelError(f"{model_dir}: cannot load the weights: {exc}") from None
            missing = sorted(info.get("missing_keys", ()))
            if missing:
                raise HfModelError(
                    f"{model_dir}: the weights lack {len(missing)} tensors of the model "
                    f"({', '.join(missing[:5])}); a pretrained start needs them all"
                )
        else:
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, attn_implementation=attn_implementation
            )
    model.config.use_cache = False  # training never reuses past keys and values
    return model  # type: ignore[no-any-return]


def decoder_layers(model: nn.Module) -> tuple[nn.Module, ...]:
    """The model's repeated blocks: the modules its class names as never to be split."""
    inner = unwrap_model(model)
    names = set(getattr(inner, "_no_split_modules", None) or ())
    layers = tuple(m for m in inner.modules() if type(m).__name__ in names)
    if not layers:
        raise HfModelError(f"{type(inner).__name__} names no decoder layer class")
    return layers


def embeddings_tied(model: nn.Module) -> bool:
    """Whether the output head reads the input embedding's very weight."""
    inner: Any = unwrap_model(model)
    head = inner.get_output_embeddings()
    return head is None or head.weight is inner.get_input_embeddings().weight


def fsdp_units(model: nn.Module) -> Sequence[nn.Module]:
    """The blocks, and the embedding and the head when they are not one tensor."""
    inner: Any = unwrap_model(model)
    layers = decoder_layers(inner)
    if embeddings_tied(inner):
        # The head reads the embedding's weight outside the embedding's own forward:
        # both stay in the root unit.
        return layers
    return (inner.get_input_embeddings(), *layers, inner.get_output_embeddings())


def fill_rotary_buffers(model: nn.Module) -> None:
    """Fill the tensors θ does not carry of a model built on the meta device.

    In the architectures transformers ships these are the rotary embeddings' frequency
    tables (non-persistent buffers). Each such module is built again on the host from its
    config, as ``from_config`` builds it, and its buffers are copied in, so every device
    holds the same bits. Any other tensor outside θ is an error naming it.
    """
    inner = unwrap_model(model)
    for name, module in inner.named_modules():
        own = [
            key
            for key, _ in module.named_buffers(recurse=False)
            if key in module._non_persistent_buffers_set
        ]
        if not own:
            continue
        config = getattr(module, "config", None)
        if config is None or not type(module).__name__.endswith("RotaryEmbedding"):
            raise HfModelError(
                f"{name or type(inner).__name__} holds tensors θ does not carry "
                f"({', '.join(own)}) and is not a rotary embedding this task can rebuild"
            )
        with torch.device("cpu"):
            fresh = type(module)(config)
        with torch.no_grad():
            for key in own:
                getattr(module, key).copy_(getattr(fresh, key))


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the non-embedding parameters, plus attention's
    ``12 · layers · hidden · seq_len``."""
    inner: Any = unwrap_model(model)
    config = inner.config
    embedding = inner.get_input_embeddings().weight.numel()
    dense = sum(p.numel() for p in inner.parameters()) - embedding
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    return float(6.0 * dense + 12.0 * layers * hidden * seq_len)


# Files that decide what a model directory builds and holds; README, licences and the
# like do not. Tokenizer files decide how text becomes tokens.
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
_HASHED: dict[tuple[str, int, int], str] = {}
_READ_BYTES = 8 << 20


def directory_fingerprint(model_dir: Path, tokenizer_dir: Path | None, *, weights: bool) -> str:
    """sha256 over the files that decide the model: ``config.json``, the weights when
    ``weights`` (a pretrained start), and the tokenizer's files, each as its name and its
    content's sha256 (kept per process by path, size and mtime: weights are hashed once)."""
    config = model_dir / "config.json"
    if not config.is_file():
        raise HfModelError(f"{model_dir} is not a Hugging Face model directory: no config.json")
    files = [("model", config)]
    if weights:
        found = sorted(
            p
            for p in model_dir.iterdir()
            if p.is_file() and (p.suffix in _WEIGHT_SUFFIXES or p.name in _WEIGHT_INDEXES)
        )
        if not found:
            raise HfModelError(f"{model_dir} holds no weights (*.safetensors) to start from")
        files.extend(("weights", p) for p in found)
    if tokenizer_dir is not None:
        named = (tokenizer_dir / name for name in _TOKENIZER_FILES)
        files.extend(("tokenizer", p) for p in named if p.is_file())
    total = hashlib.sha256()
    for role, path in files:
        total.update(f"{role}/{path.name}\0{_file_sha256(path)}\n".encode())
    return total.hexdigest()


def _file_sha256(path: Path) -> str:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    known = _HASHED.get(key)
    if known is None:
        digest = hashlib.sha256()
        with path.open("rb") as file:
            while chunk := file.read(_READ_BYTES):
                digest.update(chunk)
        known = _HASHED[key] = digest.hexdigest()
    return known
