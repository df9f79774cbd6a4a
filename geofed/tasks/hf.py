"""``CausalLMTask``: a Hugging Face causal language model trained on each region's files.

.. code-block:: yaml

    task:
      spec: geofed.tasks.hf:CausalLMTask
      options:
        model: /models/qwen2-0.5b       # a local model directory (config.json, safetensors)
        init: pretrained                # pretrained: its weights are θ_0; random: seeded
        tokenizer: /models/qwen2-0.5b   # for text data; default: the model directory
        seq_len: 1024
        batch_size: 8                   # per worker
        lr: 3.0e-4

The model is any ``AutoModelForCausalLM`` architecture ``transformers`` supports, built
from the directory's ``config.json``; its decoder layers are the FSDP and
activation-checkpointing units (:mod:`geofed.tasks.hf_model`). Each region trains on the
datasets the job names for it, read from where its agent config says they are
(``DataShard.datasets``; :mod:`geofed.tasks.hf_data`): text is tokenized once and packed
with an end-of-sequence token after each document into ``seq_len + 1`` token blocks; the
last ``val_fraction`` of the blocks is held out, and the region evaluates θ on it.
Every path must be the same on the coordinator and in every region (task options are the
same everywhere): the coordinator builds θ_0 from the model directory.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F  # noqa: N812 -- the conventional torch alias
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from geofed.data import DataError, DatasetLocation, batch_indices, validation_batches
from geofed.data.prefetch import prefetched
from geofed.task import DataShard, Task
from geofed.tasks import hf_model
from geofed.tasks.hf_data import RegionBlocks, Tokenizer, load_tokenizer, region_blocks

__all__ = ["CausalLMOptions", "CausalLMTask"]


class CausalLMOptions(BaseModel):
    """A Hugging Face causal LM job's options (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="absolute path of a local Hugging Face model directory")
    init: Literal["pretrained", "random"] = Field(
        default="pretrained",
        description="pretrained: the directory's weights are θ_0; random: initialised "
        "from the job's seed",
    )
    tokenizer: str | None = Field(
        default=None, description="a local tokenizer directory; default: the model directory"
    )
    datasets: tuple[str, ...] | None = Field(
        default=None,
        description="which of a region's datasets to read; default: every one the job "
        "names for the region",
    )
    seq_len: int = Field(default=128, ge=2, le=1 << 20)
    batch_size: int = Field(default=8, ge=1, le=1 << 16)
    lr: float = Field(default=3e-4, gt=0)
    weight_decay: float = Field(default=0.1, ge=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    val_fraction: float = Field(default=0.05, ge=0, lt=0.5)
    val_batches: int = Field(default=4, ge=0, le=10_000)
    prefetch: int = Field(
        default=2, ge=0, le=64, description="batches read ahead in a background thread"
    )
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    seed: int = Field(default=0, ge=0, lt=2**63)

    @field_validator("model", "tokenizer")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).is_absolute():
            raise ValueError(
                f"{value!r} is relative: the coordinator and every region read the same "
                "absolute path"
            )
        return value


class CausalLMTask(Task[torch.Tensor]):
    """Next-token prediction with a Hugging Face model on each region's own data.

    A batch is ``(batch_size, seq_len + 1)`` token ids: the model reads the first
    ``seq_len`` and predicts the last ``seq_len``.
    """

    Options = CausalLMOptions

    def __init__(self, options: CausalLMOptions) -> None:
        self.options = options
        self._model_dir = Path(options.model)
        self._regions: dict[tuple[tuple[str, DatasetLocation], ...], RegionBlocks] = {}

    @cached_property
    def config(self) -> Any:
        """The model's ``PretrainedConfig`` (read once)."""
        return hf_model.load_config(self._model_dir)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer text datasets are encoded with (loaded once, when needed)."""
        return load_tokenizer(Path(self.options.tokenizer or self.options.model))

    def build_model(self, seed: int | None = None) -> nn.Module:
        return hf_model.build_causal_lm(
            self._model_dir,
            self.config,
            pretrained=self.options.init == "pretrained",
            seed=self.options.seed if seed is None else seed,
            attn_implementation=self.options.attn_implementation,
        )

    def fingerprint(self) -> str:
        """The model directory's config, its weights (a pretrained start) and the
        tokenizer's files, hashed: every region must read the coordinator's."""
        tokenizer = Path(self.options.tokenizer or self.options.model)
        return hf_model.directory_fingerprint(
            self._model_dir,
            tokenizer if tokenizer.is_dir() else None,
            weights=self.options.init == "pretrained",
        )

    def build_optimizer(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        o = self.options
        return torch.optim.AdamW(
            params, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay
        )

    def batches(self, shard: DataShard, start_step: int = 0) -> Iterator[torch.Tensor]:
        """The shard's batches from ``start_step`` on, read ahead in a background thread
        (``prefetch``), in the same order as without."""
        region = self._region(shard)  # here, not in the thread: a data error is raised at once
        return prefetched(self._batches(region, shard, start_step), self.options.prefetch)

    def _batches(
        self, region: RegionBlocks, shard: DataShard, start_step: int
    ) -> Iterator[torch.Tensor]:
        size = self.options.batch_size
        step = start_step
        while True:
            picks = batch_indices(
                len(region.train),
                seed=shard.seed,
                rank=shard.rank,
                world_size=shard.world_size,
                step=step,
                batch_size=size,
            )
            yield self._stack(region, [region.train[i] for i in picks])
            step += 1

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        device = next(model.parameters()).device
        tokens = batch.to(device)
        logits = model(input_ids=tokens[:, :-1]).logits
        # In float32 even when the model computes in bf16: the loss is what training follows.
        return F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )

    def tokens(self, batch: torch.Tensor) -> int:
        return batch.shape[0] * (batch.shape[1] - 1)

    def evaluate_region(self, model: nn.Module, shard: DataShard) -> dict[str, float]:
        """Mean next-token loss over the region's first ``val_batches`` held-out batches
        (the same on every rank)."""
        if self.options.val_batches == 0:
            return {}
        region = self._region(shard)
        batches = validation_batches(
            region.validation, batch_size=self.options.batch_size, count=self.options.val_batches
        )
        total, count = 0.0, 0
        with torch.no_grad():
            for picks in batches:
                batch = self._stack(region, picks)
                targets = self.tokens(batch)
                total += float(self.loss(model, batch)) * targets
                count += targets
        if count == 0:
            return {}
        val_loss = total / count
        return {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 80.0))}

    def fsdp_units(self, model: nn.Module) -> Sequence[nn.Module]:
        return hf_model.fsdp_units(model)

    def checkpoint_units(self, model: nn.Module) -> Sequence[nn.Module]:
        return hf_model.decoder_layers(model)

    def init_non_federated(self, model: nn.Module) -> None:
        hf_model.fill_rotary_buffers(model)

    def flops_per_token(self, model: nn.Module) -> float:
        return hf_model.flops_per_token(model, self.options.seq_len)

    def _region(self, shard: DataShard) -> RegionBlocks:
        # Every dataset read has files: one the agent config names without is an error
        # here, not a dataset silently left out of what the region trains on.
        locations = shard.located(self.options.datasets)
        # Keyed by where the data is, not only its names: a dataset moved (a reload of the
        # agent config) or another region's in this process is other data.
        key = tuple(locations.items())
        found = self._regions.get(key)
        if found is None:
            texts = any(location.format != "tokens" for location in locations.values())
            found = region_blocks(
                locations,
                None,
                tokenizer=self.tokenizer if texts else None,
                seq_len=self.options.seq_len,
                val_fraction=self.options.val_fraction,
            )
            self._regions[key] = found
        return found

    def _stack(self, region: RegionBlocks, indices: Sequence[int]) -> torch.Tensor:
        batch = torch.stack([region.blocks.block(i) for i in indices])
        vocab = int(self.config.vocab_size)
        if batch.numel() and int(batch.max()) >= vocab:
            raise DataError(
                f"token id {int(batch.max())} is outside the model's vocabulary of {vocab}"
            )
        return batch
