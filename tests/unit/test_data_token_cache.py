"""The token cache: built once, shared by concurrent builders, keyed on what it depends on."""

from __future__ import annotations

import fcntl
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from geofed.data import (
    DataError,
    DatasetLocation,
    build_token_cache,
    cache_key,
    dataset_files,
    read_cache_dtype,
)

BYTE_EOS = 256
BYTE_VOCAB = 257


def fake_byte_encode(texts: list[str]) -> list[list[int]]:
    """A fake tokenizer (the outer edge): a text's tokens are its UTF-8 bytes."""
    return [list(text.encode()) for text in texts]


class CountingEncoder:
    """A fake tokenizer that records the batches it was asked to encode."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def __call__(self, texts: list[str]) -> list[list[int]]:
        self.batches.append(list(texts))
        return fake_byte_encode(texts)


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def text_dataset(root: Path, texts: list[str]) -> tuple[DatasetLocation, list[Path]]:
    root.mkdir(parents=True, exist_ok=True)
    write_jsonl(root / "docs.jsonl", texts)
    location = DatasetLocation(path=str(root), format="jsonl")
    return location, dataset_files(location)


def build(
    location: DatasetLocation,
    files: list[Path],
    cache_dir: Path,
    encode: CountingEncoder | None = None,
    *,
    vocab_size: int = BYTE_VOCAB,
    eos_id: int = BYTE_EOS,
) -> Path:
    return build_token_cache(
        location,
        files,
        encode or CountingEncoder(),
        eos_id=eos_id,
        vocab_size=vocab_size,
        tokenizer_id="fake-bytes",
        cache_dir=cache_dir,
    )


def read_tokens(path: Path) -> list[int]:
    return [int(t) for t in np.fromfile(path, dtype=read_cache_dtype(path))]


def test_tokens_are_the_documents_each_followed_by_eos(tmp_path: Path) -> None:
    location, files = text_dataset(tmp_path / "data", ["ab", "", "c"])
    path = build(location, files, tmp_path / "cache")
    assert path.parent == tmp_path / "cache"
    assert read_tokens(path) == [97, 98, BYTE_EOS, BYTE_EOS, 99, BYTE_EOS]
    sidecar = json.loads(path.with_suffix(".json").read_text())
    assert sidecar["version"] == 1
    assert (sidecar["tokens"], sidecar["dtype"], sidecar["documents"]) == (6, "uint16", 3)
    assert path.name == f"tokens-{sidecar['key']}.bin"


def test_a_built_cache_is_reused_without_encoding(tmp_path: Path) -> None:
    location, files = text_dataset(tmp_path / "data", ["one", "two"])
    first, second = CountingEncoder(), CountingEncoder()
    path = build(location, files, tmp_path / "cache", first)
    assert build(location, files, tmp_path / "cache", second) == path
    assert first.batches == [["one", "two"]]
    assert second.batches == []


def test_documents_are_encoded_256_at_a_time(tmp_path: Path) -> None:
    location, files = text_dataset(tmp_path / "data", [str(n) for n in range(600)])
    encoder = CountingEncoder()
    build(location, files, tmp_path / "cache", encoder)
    assert [len(batch) for batch in encoder.batches] == [256, 256, 88]
    assert encoder.batches[2][-1] == "599"


@pytest.mark.parametrize(
    ("vocab_size", "dtype"), [(65_536, np.uint16), (65_537, np.uint32), (300_000, np.uint32)]
)
def test_the_element_type_fits_the_vocabulary(
    tmp_path: Path, vocab_size: int, dtype: type[np.unsignedinteger]
) -> None:
    location, files = text_dataset(tmp_path / "data", ["xyz"])
    path = build(location, files, tmp_path / "cache", vocab_size=vocab_size, eos_id=vocab_size - 1)
    assert read_cache_dtype(path) == np.dtype(dtype)
    assert path.stat().st_size == 4 * np.dtype(dtype).itemsize
    assert read_tokens(path) == [120, 121, 122, vocab_size - 1]


def test_the_key_changes_with_what_the_tokens_depend_on(tmp_path: Path) -> None:
    location, files = text_dataset(tmp_path / "data", ["abc"])
    key = cache_key(location, files, "fake-bytes", BYTE_EOS)
    assert cache_key(location, files, "fake-bytes", BYTE_EOS) == key
    assert cache_key(location, files, "other-tokenizer", BYTE_EOS) != key
    assert cache_key(location, files, "fake-bytes", 0) != key
    other_field = location.model_copy(update={"text_field": "body"})
    assert cache_key(other_field, files, "fake-bytes", BYTE_EOS) != key

    stat = files[0].stat()
    os.utime(files[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    touched = cache_key(location, files, "fake-bytes", BYTE_EOS)
    assert touched != key
    write_jsonl(files[0], ["abd"])  # same size, new content
    os.utime(files[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    # The key reads the files' stat, not their content: same size and time, same key.
    assert cache_key(location, files, "fake-bytes", BYTE_EOS) == touched
    write_jsonl(files[0], ["abcd"])
    assert cache_key(location, files, "fake-bytes", BYTE_EOS) not in {key, touched}


def test_a_changed_file_gets_a_new_cache(tmp_path: Path) -> None:
    location, files = text_dataset(tmp_path / "data", ["abc"])
    old = build(location, files, tmp_path / "cache")
    write_jsonl(files[0], ["abcd"])
    encoder = CountingEncoder()
    new = build(location, files, tmp_path / "cache", encoder)
    assert new != old
    assert encoder.batches == [["abcd"]]
    assert read_tokens(old) == [97, 98, 99, BYTE_EOS]
    assert read_tokens(new) == [97, 98, 99, 100, BYTE_EOS]


def test_tokens_without_a_sidecar_are_built_again(tmp_path: Path) -> None:
    location, files = text_dataset(tmp_path / "data", ["abc"])
    path = build(location, files, tmp_path / "cache")
    path.with_suffix(".json").unlink()  # as a builder that died before its last write
    encoder = CountingEncoder()
    assert build(location, files, tmp_path / "cache", encoder) == path
    assert encoder.batches == [["abc"]]
    assert read_tokens(path) == [97, 98, 99, BYTE_EOS]


def test_an_empty_dataset_is_an_error_and_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    (root / "docs.jsonl").write_text("\n\n", encoding="utf-8")
    location = DatasetLocation(path=str(root), format="jsonl")
    with pytest.raises(DataError, match="holds no documents"):
        build(location, dataset_files(location), tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_ids_outside_the_vocabulary_are_an_error(tmp_path: Path) -> None:
    location, files = text_dataset(tmp_path / "data", ["é"])  # bytes 195, 169
    with pytest.raises(DataError, match=r"outside the vocabulary \[0, 190\)"):
        build(location, files, tmp_path / "cache", vocab_size=190, eos_id=0)
    assert not list((tmp_path / "cache").glob("*.bin"))


def test_an_eos_outside_the_vocabulary_is_refused(tmp_path: Path) -> None:
    location, files = text_dataset(tmp_path / "data", ["a"])
    with pytest.raises(ValueError, match="eos_id 257 is outside"):
        build(location, files, tmp_path / "cache", eos_id=257)


def test_concurrent_builders_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two builders at once: the second waits on the lock, then reuses the first's cache."""
    location, files = text_dataset(tmp_path / "data", ["shared"])
    lock_requests: list[str] = []
    second_asked_for_lock = threading.Event()
    real_flock = fcntl.flock

    def recording_flock(fd: int, operation: int) -> None:
        lock_requests.append(threading.current_thread().name)
        if threading.current_thread().name == "second":
            second_asked_for_lock.set()
        real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", recording_flock)
    encoding = threading.Event()
    calls: list[str] = []

    def slow_encode(texts: list[str]) -> list[list[int]]:
        calls.append(threading.current_thread().name)
        encoding.set()
        # Hold the lock until the second builder has asked for it, so it must wait.
        assert second_asked_for_lock.wait(timeout=10)
        return fake_byte_encode(texts)

    results: dict[str, Path] = {}

    def run() -> None:
        name = threading.current_thread().name
        results[name] = build_token_cache(
            location,
            files,
            slow_encode,
            eos_id=BYTE_EOS,
            vocab_size=BYTE_VOCAB,
            tokenizer_id="fake-bytes",
            cache_dir=tmp_path / "cache",
        )

    first = threading.Thread(target=run, name="first")
    second = threading.Thread(target=run, name="second")
    first.start()
    assert encoding.wait(timeout=10)
    second.start()
    first.join(timeout=10)
    second.join(timeout=10)
    assert calls == ["first"]
    assert lock_requests == ["first", "second"]
    assert results["first"] == results["second"]
    assert read_tokens(results["first"]) == [*b"shared", BYTE_EOS]


def test_reading_the_dtype_of_a_cache_without_sidecar_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "tokens-0.bin"
    path.write_bytes(b"\0\0")
    with pytest.raises(DataError, match="cannot read"):
        read_cache_dtype(path)
    path.with_suffix(".json").write_text('{"dtype": "int8"}')
    with pytest.raises(DataError, match="dtype 'int8' is not one of"):
        read_cache_dtype(path)
