"""``LlamaTask``: a Llama-style decoder on the byte corpus ``CharLMTask`` trains on."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Self

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from geofed.examples.charlm.data import VOCAB_SIZE, ByteCorpusTask
from geofed.examples.llama.model import Llama, LlamaConfig, rotary_table
from geofed.examples.llama.presets import PRESETS, PresetName
from geofed.params import unwrap_model


class LlamaOptions(BaseModel):
    """Options of :class:`LlamaTask`: a preset, sizes that override it, and training knobs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: PresetName = Field(default="tiny", description="named size: tiny, 125m, 350m, 1b")
    dim: int | None = Field(default=None, ge=8, description="residual width; default: preset's")
    n_layers: int | None = Field(default=None, ge=1, description="blocks; default: preset's")
    n_heads: int | None = Field(default=None, ge=1, description="query heads; must divide dim")
    n_kv_heads: int | None = Field(
        default=None, ge=1, description="key/value heads; must divide n_heads"
    )
    ffn_dim: int | None = Field(default=None, ge=1, description="SwiGLU hidden width")
    tie_embeddings: bool = Field(default=False, description="output head reuses the embedding")
    rope_theta: float = Field(default=10000.0, gt=0.0, description="rotary base period")
    seq_len: int = Field(default=128, ge=2, description="bytes of context per training sample")
    batch_size: int = Field(default=8, ge=1, description="samples per step per worker")
    lr: float = Field(default=1e-3, gt=0.0, description="inner AdamW learning rate")
    weight_decay: float = Field(default=0.1, ge=0.0, description="inner AdamW weight decay")
    beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    beta2: float = Field(default=0.95, ge=0.0, lt=1.0)
    seed: int = Field(default=0, ge=0, description="model initialisation seed")
    val_batches: int = Field(default=8, ge=1, description="batches of batch_size per evaluation")
    corpus_dir: Path | None = Field(
        default=None, description="tree of .py files to train on; default: the standard library"
    )

    @model_validator(mode="after")
    def _sizes_fit(self) -> Self:
        self.architecture()  # its ValueError names the sizes that do not fit
        return self

    def architecture(self) -> LlamaConfig:
        """The model these options describe: the preset with the sizes given here."""
        preset = PRESETS[self.preset]
        return LlamaConfig(
            vocab_size=VOCAB_SIZE,
            dim=preset.dim if self.dim is None else self.dim,
            n_layers=preset.n_layers if self.n_layers is None else self.n_layers,
            n_heads=preset.n_heads if self.n_heads is None else self.n_heads,
            n_kv_heads=preset.n_kv_heads if self.n_kv_heads is None else self.n_kv_heads,
            ffn_dim=preset.ffn_dim if self.ffn_dim is None else self.ffn_dim,
            max_seq_len=self.seq_len,
            tie_embeddings=self.tie_embeddings,
            rope_theta=self.rope_theta,
        )


class LlamaTask(ByteCorpusTask):
    """Next-byte prediction with a Llama-style decoder, data split by region as charlm's.

    Each transformer block is an FSDP unit and an activation-checkpointing unit; the
    embedding and the output head are FSDP units too (unless tied). The model builds on
    the ``meta`` device: its one non-federated tensor, the RoPE table, is recomputed by
    :meth:`init_non_federated`.
    """

    Options = LlamaOptions

    def __init__(self, options: LlamaOptions | None = None) -> None:
        self.options = options if options is not None else LlamaOptions()
        self.config = self.options.architecture()
        super().__init__(self.options)

    def build_model(self, seed: int | None = None) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.options.seed if seed is None else seed)
            return Llama(self.config)

    def fsdp_units(self, model: nn.Module) -> Sequence[nn.Module]:
        llama = _llama(model)
        if llama.output is None:
            # Tied: the head reads the embedding's weight outside the embedding's own
            # forward, so both stay in the root unit.
            return tuple(llama.layers)
        # The embedding and the head are the largest tensors: units of their own, so
        # each is gathered only around its own forward and backward.
        return (llama.tok_embeddings, *llama.layers, llama.output)

    def init_non_federated(self, model: nn.Module) -> None:
        llama = _llama(model)
        config = llama.config
        # Computed on the host, as build_model does, so every device holds the same bits.
        table = rotary_table(config.head_dim, config.max_seq_len, config.rope_theta)
        with torch.no_grad():
            llama.freqs_cis.copy_(table)

    def checkpoint_units(self, model: nn.Module) -> Sequence[nn.Module]:
        return tuple(_llama(model).layers)

    def flops_per_token(self, model: nn.Module) -> float:
        return _llama(model).config.flops_per_token(self.options.seq_len)


def _llama(model: nn.Module) -> Llama:
    inner = unwrap_model(model)
    if not isinstance(inner, Llama):
        raise TypeError(f"expected the Llama this task builds, got {type(inner).__name__}")
    return inner
