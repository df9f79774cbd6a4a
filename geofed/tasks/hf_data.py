"""A region's datasets as one sequence of token blocks, for a Hugging Face model.

Text datasets (parquet, JSON lines, text) are tokenized once with the job's tokenizer,
each document followed by the tokenizer's end-of-sequence token, into a cache beside the
region's data (:func:`geofed.data.build_token_cache`); token datasets are read as they
are. The region's blocks are its datasets' blocks in dataset name order; the last ones
are held out for validation (:func:`geofed.data.split`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from geofed.data import (
    DataError,
    DatasetLocation,
    TokenBlocks,
    build_token_cache,
    dataset_files,
    read_cache_dtype,
    split,
)
from geofed.tasks.hf_model import HfModelError, transformers_module

__all__ = ["RegionBlocks", "Tokenizer", "load_tokenizer", "region_blocks"]


@dataclass(frozen=True, slots=True)
class Tokenizer:
    """What tokenizing needs: the encoder, its end-of-sequence id, size and identity."""

    encoder: Any
    eos_id: int
    vocab_size: int
    id: str

    def encode(self, texts: list[str]) -> list[list[int]]:
        encoded = self.encoder(texts, add_special_tokens=False)["input_ids"]
        return [list(ids) for ids in encoded]


def load_tokenizer(directory: Path) -> Tokenizer:
    """The tokenizer saved in ``directory`` (``save_pretrained``'s files), local only."""
    transformers = transformers_module()
    try:
        encoder = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise HfModelError(f"{directory}: cannot load a tokenizer: {exc}") from None
    eos = encoder.eos_token_id
    if not isinstance(eos, int):
        raise HfModelError(
            f"{directory}: the tokenizer has no end-of-sequence token to separate documents"
        )
    digest = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        if path.is_file() and ("token" in path.name or path.suffix in (".model", ".txt")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return Tokenizer(encoder, eos, len(encoder), digest.hexdigest()[:24])


@dataclass(frozen=True, slots=True)
class RegionBlocks:
    """The region's blocks and which of them train and which validate."""

    blocks: TokenBlocks
    train: range
    validation: range


def region_blocks(
    locations: Mapping[str, DatasetLocation],
    names: Sequence[str] | None,
    *,
    tokenizer: Tokenizer | None,
    seq_len: int,
    val_fraction: float,
) -> RegionBlocks:
    """The blocks of the datasets ``names`` (None: every one given), held out at the tail.

    Raises :class:`~geofed.data.DataError` naming what is missing: a dataset without a
    location in the agent config, or text without a tokenizer.
    """
    chosen = sorted(locations) if names is None else sorted(names)
    if not chosen:
        raise DataError(
            "the region gives this job no dataset files: name each dataset's path, format "
            "and fields under datasets: in the agent config"
        )
    files: list[tuple[Path, np.dtype[Any]]] = []
    for name in chosen:
        location = locations.get(name)
        if location is None:
            raise DataError(
                f"dataset {name} has no files in this region's agent config "
                f"(datasets: {{{name}: {{path: ..., format: ...}}}})"
            )
        files.extend(_token_files(name, location, tokenizer))
    blocks = TokenBlocks(files, seq_len)
    train, validation = split(len(blocks), val_fraction)
    return RegionBlocks(blocks, train, validation)


def _token_files(
    name: str, location: DatasetLocation, tokenizer: Tokenizer | None
) -> list[tuple[Path, np.dtype[Any]]]:
    found = dataset_files(location)
    if location.format == "tokens":
        return [(path, np.dtype(location.dtype)) for path in found]
    if tokenizer is None:
        raise DataError(f"dataset {name} is {location.format}: it needs a tokenizer")
    if location.cache_dir is None:
        raise DataError(f"dataset {name}: no cache_dir to keep its tokens in")
    cache = build_token_cache(
        location,
        found,
        tokenizer.encode,
        eos_id=tokenizer.eos_id,
        vocab_size=tokenizer.vocab_size,
        tokenizer_id=tokenizer.id,
        cache_dir=Path(location.cache_dir),
    )
    return [(cache, read_cache_dtype(cache))]
