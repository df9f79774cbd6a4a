"""Tokenizing a text dataset once, into a flat token file that every rank memory-maps.

The cache is ``tokens-<key>.bin`` (the documents' tokens, each document followed by the
end-of-sequence token) with its sidecar ``tokens-<key>.json``. The key covers everything
the tokens depend on: the files (path, size, modification time), how they are read and
the tokenizer, so a changed file or tokenizer gets a new cache rather than stale tokens.
The sidecar is written last: its presence means the ``.bin`` beside it is complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from geofed.data.documents import iter_documents
from geofed.data.location import DataError, DatasetLocation
from geofed.fsutil import AtomicFile, atomic_write_bytes

__all__ = ["Encode", "build_token_cache", "cache_key", "read_cache_dtype"]

Encode = Callable[[list[str]], list[list[int]]]
"""A tokenizer's batch encoder: one list of token ids per text, without special tokens."""

_FORMAT_VERSION: Final = 1
_BATCH_DOCUMENTS: Final = 256
_KEY_CHARS: Final = 24
_DTYPES: Final = frozenset({"uint16", "uint32"})


def cache_key(
    location: DatasetLocation, files: Sequence[Path], tokenizer_id: str, eos_id: int
) -> str:
    """The cache's name: a sha256 (24 hex digits) of what its tokens depend on."""
    listed: list[tuple[str, int, int]] = []
    for path in files:
        try:
            stat = path.stat()
        except OSError as error:
            raise DataError(f"{path}: cannot stat: {error.strerror}") from error
        listed.append((str(path), stat.st_size, stat.st_mtime_ns))
    record = {
        "format": location.format,
        "text_field": location.text_field,
        "files": listed,
        "tokenizer": tokenizer_id,
        "eos_id": eos_id,
    }
    encoded = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(encoded).hexdigest()[:_KEY_CHARS]


def build_token_cache(
    location: DatasetLocation,
    files: Sequence[Path],
    encode: Encode,
    *,
    eos_id: int,
    vocab_size: int,
    tokenizer_id: str,
    cache_dir: Path,
) -> Path:
    """Tokenize ``files`` into ``cache_dir`` unless already done; return the ``.bin`` path.

    Documents are encoded 256 at a time and each is followed by ``eos_id``; tokens are
    stored as uint16 when ``vocab_size`` <= 65536, else uint32. Several ranks of a region
    may call this at once: an exclusive lock on ``tokens-<key>.lock`` lets one build while
    the others wait, then find the cache complete and reuse it. A dataset with no
    documents, or an encoder returning ids outside the vocabulary, raises DataError.
    """
    if not 1 <= vocab_size <= 1 << 32:
        raise ValueError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
    if not 0 <= eos_id < vocab_size:
        raise ValueError(f"eos_id {eos_id} is outside the vocabulary [0, {vocab_size})")
    dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
    key = cache_key(location, files, tokenizer_id, eos_id)
    tokens_path = cache_dir / f"tokens-{key}.bin"
    if _is_complete(tokens_path, key, dtype):
        return tokens_path
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DataError(f"token cache {cache_dir}: cannot create: {error.strerror}") from error
    with _exclusive_lock(cache_dir / f"tokens-{key}.lock"):
        # Another rank may have built it while this one waited for the lock.
        if not _is_complete(tokens_path, key, dtype):
            tokens, documents = _write_tokens(
                tokens_path, location, files, encode, eos_id, vocab_size, dtype
            )
            sidecar = {
                "version": _FORMAT_VERSION,
                "key": key,
                "tokens": tokens,
                "dtype": dtype.name,
                "documents": documents,
                "tokenizer": tokenizer_id,
                "eos_id": eos_id,
            }
            atomic_write_bytes(_sidecar_path(tokens_path), json.dumps(sidecar).encode())
    return tokens_path


def read_cache_dtype(path: Path) -> np.dtype[Any]:
    """The element type of the cache ``path`` (a ``.bin`` :func:`build_token_cache` wrote)."""
    sidecar = _sidecar_path(path)
    try:
        meta = json.loads(sidecar.read_bytes())
    except OSError as error:
        raise DataError(f"{sidecar}: cannot read: {error.strerror}") from error
    except ValueError as error:
        raise DataError(f"{sidecar}: not JSON: {error}") from error
    name = meta.get("dtype") if isinstance(meta, dict) else None
    if name not in _DTYPES:
        raise DataError(f"{sidecar}: dtype {name!r} is not one of {sorted(_DTYPES)}")
    return np.dtype(name)


def _sidecar_path(tokens_path: Path) -> Path:
    return tokens_path.with_suffix(".json")


def _is_complete(tokens_path: Path, key: str, dtype: np.dtype[Any]) -> bool:
    try:
        meta = json.loads(_sidecar_path(tokens_path).read_bytes())
        size = tokens_path.stat().st_size
    except (OSError, ValueError):
        return False
    # A sidecar of another format version, or one not matching its .bin, is rebuilt over.
    return (
        isinstance(meta, dict)
        and meta.get("version") == _FORMAT_VERSION
        and meta.get("key") == key
        and meta.get("dtype") == dtype.name
        and isinstance(meta.get("tokens"), int)
        and meta["tokens"] * dtype.itemsize == size
    )


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    # flock belongs to the open file description, so each caller opens its own: other
    # processes, and other threads of this one, wait on it alike. Closing releases it.
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as error:
        raise DataError(f"token cache lock {path}: cannot open: {error.strerror}") from error
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_tokens(
    tokens_path: Path,
    location: DatasetLocation,
    files: Sequence[Path],
    encode: Encode,
    eos_id: int,
    vocab_size: int,
    dtype: np.dtype[Any],
) -> tuple[int, int]:
    """Write the tokens to ``tokens_path`` atomically; return (tokens, documents)."""
    tokens = documents = 0
    eos = np.array([eos_id], dtype=np.int64)
    with AtomicFile(tokens_path) as out:  # removed again if anything below raises
        for batch in _batches(iter_documents(location, files), _BATCH_DOCUMENTS):
            encoded = encode(batch)
            if len(encoded) != len(batch):
                raise DataError(
                    f"dataset {location.path}: the tokenizer returned {len(encoded)} "
                    f"encodings for {len(batch)} documents"
                )
            parts: list[np.ndarray[Any, np.dtype[np.int64]]] = []
            for ids in encoded:
                array = np.asarray(ids, dtype=np.int64).reshape(-1)
                if array.size and (array.min() < 0 or array.max() >= vocab_size):
                    raise DataError(
                        f"dataset {location.path}: the tokenizer returned an id outside "
                        f"the vocabulary [0, {vocab_size})"
                    )
                parts.extend((array, eos))
            chunk = np.concatenate(parts).astype(dtype)
            out.write(chunk.tobytes())
            tokens += chunk.size
            documents += len(batch)
        if tokens == 0:
            raise DataError(f"dataset {location.path}: holds no documents to tokenize")
    return tokens, documents


def _batches(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
