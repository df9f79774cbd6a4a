"""The byte corpus as batches: what every byte-level example task trains and evaluates on.

:class:`ByteBatches` turns the corpus (:mod:`geofed.examples.charlm.corpus`) into a
region's training batches and a fixed validation pass; :func:`next_byte_loss` is the
loss of a model mapping byte ids to next-byte logits. ``CharLMTask`` and ``LlamaTask``
differ only in their model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F  # noqa: N812 -- the conventional torch alias
from torch import nn

from geofed.examples.charlm.corpus import Corpus, load_corpus
from geofed.examples.charlm.sampling import WindowSampler
from geofed.params import unwrap_model
from geofed.task import DataShard, Task

VOCAB_SIZE = 256


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """Input bytes and next-byte targets, both ``(batch, seq_len)`` int64."""

    inputs: torch.Tensor
    targets: torch.Tensor


def next_byte_loss(model: nn.Module, batch: TokenBatch) -> torch.Tensor:
    """Mean cross-entropy of ``model``'s ``(batch, time, 256)`` logits against the targets."""
    device = next(model.parameters()).device
    # In float32 even when the model computes in bf16: the loss is what training follows.
    logits = model(batch.inputs.to(device)).float()
    return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), batch.targets.to(device).reshape(-1))


class ByteBatches:
    """A region's training windows and the shared validation windows of the corpus.

    Region ``i`` of ``n`` trains on group ``i`` of the corpus split into ``n`` groups of
    whole top-level packages; everyone evaluates on the same held-out files.
    """

    def __init__(
        self, *, corpus_dir: Path | None, seq_len: int, batch_size: int, val_batches: int
    ) -> None:
        self.corpus_dir = corpus_dir
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_batches = val_batches
        self._groups: dict[tuple[int, int], torch.Tensor] = {}
        self._validation: torch.Tensor | None = None

    @property
    def corpus(self) -> Corpus:
        """The corpus (loaded once per process)."""
        return load_corpus(self.corpus_dir)

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
        """The shard's batches from ``start_step`` on; the batch at a step is fixed."""
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        data = self._group(shard)
        window = self.seq_len + 1
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
        batch_size = self.batch_size
        offsets = torch.arange(sampler.window, dtype=torch.int64)
        step = start_step
        while True:
            starts = sampler.starts(step * batch_size, batch_size)
            yield _to_batch(data[starts[:, None] + offsets])
            step += 1

    def evaluate(
        self, model: nn.Module, loss: Callable[[nn.Module, TokenBatch], torch.Tensor]
    ) -> dict[str, float]:
        """Mean next-byte ``loss`` over ``val_batches`` fixed, evenly spaced windows.

        A DDP wrapper is looked through, so one rank can evaluate without the others.
        """
        model = unwrap_model(model)
        data = self._validation_data()
        window = self.seq_len + 1
        count = self.val_batches * self.batch_size
        if data.numel() < window:
            raise ValueError(f"validation split ({data.numel()} bytes) is shorter than one window")
        starts = torch.linspace(0, data.numel() - window, count, dtype=torch.float64).long()
        offsets = torch.arange(window, dtype=torch.int64)
        was_training = model.training
        model.eval()
        total = 0.0
        try:
            with torch.no_grad():
                for first in range(0, count, self.batch_size):
                    chunk = starts[first : first + self.batch_size]
                    batch = _to_batch(data[chunk[:, None] + offsets])
                    total += float(loss(model, batch)) * batch.targets.numel()
        finally:
            model.train(was_training)
        val_loss = total / (count * self.seq_len)
        return {"val_loss": val_loss, "val_bits_per_byte": val_loss / math.log(2)}


def _as_tensor(data: bytes) -> torch.Tensor:
    # bytearray: torch.frombuffer warns on (and must not alias) an immutable buffer.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _to_batch(windows: torch.Tensor) -> TokenBatch:
    ids = windows.to(torch.int64)
    return TokenBatch(inputs=ids[:, :-1].contiguous(), targets=ids[:, 1:].contiguous())


class ByteCorpusOptions(Protocol):
    """The options every task on the byte corpus has (read-only here)."""

    @property
    def corpus_dir(self) -> Path | None: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def val_batches(self) -> int: ...
    @property
    def lr(self) -> float: ...
    @property
    def beta1(self) -> float: ...
    @property
    def beta2(self) -> float: ...
    @property
    def weight_decay(self) -> float: ...


class ByteCorpusTask(Task[TokenBatch]):
    """A next-byte task on the corpus: its batches, AdamW, the loss and the evaluation.

    A subclass builds its model (:meth:`~geofed.task.Task.build_model`) and may declare
    the optional hooks; the rest is the same for every byte-level example.
    """

    def __init__(self, options: ByteCorpusOptions) -> None:
        self._data = ByteBatches(
            corpus_dir=options.corpus_dir,
            seq_len=options.seq_len,
            batch_size=options.batch_size,
            val_batches=options.val_batches,
        )
        self._adamw = (options.lr, (options.beta1, options.beta2), options.weight_decay)

    @property
    def corpus(self) -> Corpus:
        """The corpus this task reads (loaded once per process)."""
        return self._data.corpus

    def build_optimizer(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        lr, betas, weight_decay = self._adamw
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)

    def batches(self, shard: DataShard, start_step: int = 0) -> Iterator[TokenBatch]:
        return self._data.batches(shard, start_step)

    def loss(self, model: nn.Module, batch: TokenBatch) -> torch.Tensor:
        return next_byte_loss(model, batch)

    def tokens(self, batch: TokenBatch) -> int:
        return batch.targets.numel()

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Mean next-byte loss over ``val_batches`` fixed, evenly spaced validation windows.

        A DDP wrapper is looked through, so one rank can evaluate without the others.
        """
        return self._data.evaluate(model, self.loss)
