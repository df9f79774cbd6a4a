"""``CharLMTask``: a byte-level language model over Python source, split non-IID by region."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import torch
import torch.nn.functional as F  # noqa: N812 -- the conventional torch alias
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from geofed.examples.charlm.corpus import Corpus, load_corpus
from geofed.examples.charlm.model import VOCAB_SIZE, CharTransformer
from geofed.examples.charlm.sampling import WindowSampler
from geofed.params import unwrap_model
from geofed.task import DataShard, Task


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


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """Input bytes and next-byte targets, both ``(batch, seq_len)`` int64."""

    inputs: torch.Tensor
    targets: torch.Tensor


class CharLMTask(Task[TokenBatch]):
    """Next-byte prediction on Python source; each region trains on its own packages.

    Region ``i`` of ``n`` trains on group ``i`` of the corpus split into ``n`` groups of
    whole top-level packages; every region and the coordinator evaluate on the same
    held-out files.
    """

    Options = CharLMOptions

    def __init__(self, options: CharLMOptions | None = None) -> None:
        self.options = options if options is not None else CharLMOptions()
        self._groups: dict[tuple[int, int], torch.Tensor] = {}
        self._validation: torch.Tensor | None = None

    @property
    def corpus(self) -> Corpus:
        """The corpus this task reads (loaded once per process)."""
        return load_corpus(self.options.corpus_dir)

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

    def build_optimizer(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        opts = self.options
        return torch.optim.AdamW(
            params, lr=opts.lr, betas=(opts.beta1, opts.beta2), weight_decay=opts.weight_decay
        )

    def _group(self, shard: DataShard) -> torch.Tensor:
        key = (shard.region_index, shard.num_regions)
        if key not in self._groups:
            data = self.corpus.group_data(shard.region_index, shard.num_regions)
            self._groups[key] = _as_tensor(data)
        return self._groups[key]

    def _validation_data(self) -> torch.Tensor:
        if self._validation is None:
            self._validation = _as_tensor(self.corpus.validation)
        return self._validation

    def batches(self, shard: DataShard, start_step: int = 0) -> Iterator[TokenBatch]:
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        data = self._group(shard)
        window = self.options.seq_len + 1
        sampler = WindowSampler(
            stream_len=data.numel(),
            window=window,
            rank=shard.rank,
            world_size=shard.world_size,
            key=(shard.seed, shard.region_index, shard.num_regions, shard.world_size),
        )
        return self._iterate(data, sampler, start_step)

    def _iterate(
        self, data: torch.Tensor, sampler: WindowSampler, start_step: int
    ) -> Iterator[TokenBatch]:
        batch_size = self.options.batch_size
        offsets = torch.arange(sampler.window, dtype=torch.int64)
        step = start_step
        while True:
            starts = sampler.starts(step * batch_size, batch_size)
            yield _to_batch(data[starts[:, None] + offsets])
            step += 1

    def loss(self, model: nn.Module, batch: TokenBatch) -> torch.Tensor:
        device = next(model.parameters()).device
        logits = model(batch.inputs.to(device))
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), batch.targets.to(device).reshape(-1))

    def tokens(self, batch: TokenBatch) -> int:
        return batch.targets.numel()

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Mean next-byte loss over ``val_batches`` fixed, evenly spaced validation windows.

        A DDP wrapper is looked through, so one rank can evaluate without the others.
        """
        model = unwrap_model(model)
        opts = self.options
        data = self._validation_data()
        window = opts.seq_len + 1
        count = opts.val_batches * opts.batch_size
        if data.numel() < window:
            raise ValueError(f"validation split ({data.numel()} bytes) is shorter than one window")
        starts = torch.linspace(0, data.numel() - window, count, dtype=torch.float64).long()
        offsets = torch.arange(window, dtype=torch.int64)
        was_training = model.training
        model.eval()
        total = 0.0
        try:
            with torch.no_grad():
                for first in range(0, count, opts.batch_size):
                    chunk = starts[first : first + opts.batch_size]
                    batch = _to_batch(data[chunk[:, None] + offsets])
                    total += float(self.loss(model, batch)) * batch.targets.numel()
        finally:
            model.train(was_training)
        val_loss = total / (count * opts.seq_len)
        return {"val_loss": val_loss, "val_bits_per_byte": val_loss / math.log(2)}


def _as_tensor(data: bytes) -> torch.Tensor:
    # bytearray: torch.frombuffer warns on (and must not alias) an immutable buffer.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _to_batch(windows: torch.Tensor) -> TokenBatch:
    ids = windows.to(torch.int64)
    return TokenBatch(inputs=ids[:, :-1].contiguous(), targets=ids[:, 1:].contiguous())
