"""``CharLMTask``: a byte-level language model over Python source, split non-IID by region."""

from __future__ import annotations

from pathlib import Path
from typing import Self

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from geofed.examples.charlm.data import ByteCorpusTask
from geofed.examples.charlm.model import CharTransformer


class CharLMOptions(BaseModel):
    """Options of :class:`CharLMTask`.

    The defaults give a ~0.28M-parameter model whose inner step takes a few tens of
    milliseconds on one CPU thread; ``d_model=512, n_layers=8`` gives ~25M parameters.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    d_model: int = Field(default=96, ge=8, description="width of the residual stream")
    n_layers: int = Field(default=2, ge=1, description="number of transformer blocks")
    n_heads: int = Field(default=4, ge=1, description="attention heads; must divide d_model")
    d_ff: int | None = Field(default=None, ge=1, description="MLP width; default 4 * d_model")
    seq_len: int = Field(default=64, ge=2, description="bytes of context per training sample")
    batch_size: int = Field(default=16, ge=1, description="samples per step per worker")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    lr: float = Field(default=3e-3, gt=0.0, description="inner AdamW learning rate")
    weight_decay: float = Field(default=0.1, ge=0.0, description="inner AdamW weight decay")
    beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    beta2: float = Field(default=0.95, ge=0.0, lt=1.0)
    seed: int = Field(default=0, ge=0, description="model initialisation seed")
    val_batches: int = Field(default=8, ge=1, description="batches of batch_size per evaluation")
    corpus_dir: Path | None = Field(
        default=None, description="tree of .py files to train on; default: the standard library"
    )

    @model_validator(mode="after")
    def _heads_divide_width(self) -> Self:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        return self


class CharLMTask(ByteCorpusTask):
    """Next-byte prediction on Python source; each region trains on its own packages.

    Region ``i`` of ``n`` trains on group ``i`` of the corpus split into ``n`` groups of
    whole top-level packages; every region and the coordinator evaluate on the same
    held-out files.
    """

    Options = CharLMOptions

    def __init__(self, options: CharLMOptions | None = None) -> None:
        self.options = options if options is not None else CharLMOptions()
        super().__init__(self.options)

    def build_model(self, seed: int | None = None) -> nn.Module:
        opts = self.options
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(opts.seed if seed is None else seed)
            return CharTransformer(
                d_model=opts.d_model,
                n_layers=opts.n_layers,
                n_heads=opts.n_heads,
                d_ff=opts.d_ff if opts.d_ff is not None else 4 * opts.d_model,
                max_len=opts.seq_len,
                dropout=opts.dropout,
            )
