"""Content-addressed blob store on the filesystem."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geofed.blobstore import (
    BlobDigestMismatch,
    BlobNotFound,
    BlobStore,
    CorruptBlob,
    FsBlobStore,
    InvalidDigest,
    sha256_hex,
    validate_digest,
)


@pytest.fixture
def store(tmp_path: Path) -> FsBlobStore:
    return FsBlobStore(tmp_path / "blobs", chunk_size=1024)


def corrupt(store: FsBlobStore, digest: str, data: bytes) -> None:
    path = store.path_of(digest)
    path.chmod(0o600)
    path.write_bytes(data)


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def test_put_get_round_trip_and_layout(store: FsBlobStore) -> None:
    data = b"model delta bytes" * 100
    digest = store.put(data)
    assert digest == hashlib.sha256(data).hexdigest()
    path = store.root / digest[:2] / digest[2:]
    assert path.is_file()
    assert store.path_of(digest) == path
    assert store.get(digest) == data
    assert store.exists(digest)
    assert store.size(digest) == len(data)
    assert isinstance(store, BlobStore)


def test_put_is_idempotent(store: FsBlobStore) -> None:
    first = store.put(b"same")
    mtime = store.path_of(first).stat().st_mtime_ns
    assert store.put(b"same") == first
    assert store.put_stream([b"sa", b"me"]) == first
    assert store.path_of(first).stat().st_mtime_ns == mtime  # not rewritten
    assert list(store.iter_digests()) == [first]
    assert temp_files(store.root) == []


def test_blobs_and_dirs_are_private(store: FsBlobStore) -> None:
    digest = store.put(b"x")
    assert stat.S_IMODE(store.path_of(digest).stat().st_mode) == 0o600
    assert stat.S_IMODE(store.path_of(digest).parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700


def test_put_with_wrong_expected_digest_stores_nothing(store: FsBlobStore) -> None:
    wrong = sha256_hex(b"something else")
    with pytest.raises(BlobDigestMismatch, match=wrong):
        store.put(b"data", expected_digest=wrong)
    with pytest.raises(BlobDigestMismatch):
        store.put_stream([b"da", b"ta"], expected_digest=wrong)
    assert list(store.iter_digests()) == []
    assert temp_files(store.root) == []
    assert store.put(b"data", expected_digest=sha256_hex(b"data")) == sha256_hex(b"data")


def test_put_stream_matches_put(store: FsBlobStore) -> None:
    chunks = [os.urandom(1000) for _ in range(7)]
    digest = store.put_stream(iter(chunks))
    assert digest == sha256_hex(b"".join(chunks))
    assert store.get(digest) == b"".join(chunks)
    assert store.put_stream([]) == sha256_hex(b"")
    assert store.get(sha256_hex(b"")) == b""


def test_put_stream_failing_midway_leaves_nothing(store: FsBlobStore) -> None:
    def chunks() -> Iterator[bytes]:
        yield b"first"
        raise ConnectionResetError("upload cut off")

    with pytest.raises(ConnectionResetError):
        store.put_stream(chunks())
    assert list(store.iter_digests()) == []
    assert temp_files(store.root) == []


def test_put_written_stores_what_a_serializer_writes(store: FsBlobStore) -> None:
    value = {"w": torch.arange(1000, dtype=torch.float32), "step": torch.tensor(3)}
    digest = store.put_written(lambda file: torch.save(value, file))
    buffer = io.BytesIO()
    torch.save(value, buffer)
    assert digest == sha256_hex(buffer.getvalue())  # the same bytes, never held whole
    assert store.get(digest) == buffer.getvalue()
    assert store.put_written(lambda file: torch.save(value, file)) == digest  # idempotent


def test_put_written_failing_midway_leaves_nothing(store: FsBlobStore) -> None:
    def write(file: BinaryIO) -> None:
        file.write(b"half a model")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        store.put_written(write)
    assert list(store.iter_digests()) == []
    assert temp_files(store.root) == []


def test_get_detects_corruption(store: FsBlobStore) -> None:
    digest = store.put(b"original")
    corrupt(store, digest, b"0riginal")
    with pytest.raises(CorruptBlob, match=digest):
        store.get(digest)


def test_truncated_blob_is_corrupt(store: FsBlobStore) -> None:
    digest = store.put(b"a longer original")
    corrupt(store, digest, b"a longer")
    with pytest.raises(CorruptBlob):
        store.get(digest)


def test_put_replaces_a_corrupt_copy(store: FsBlobStore) -> None:
    digest = store.put(b"original")
    corrupt(store, digest, b"garbage")
    assert store.put(b"original") == digest
    assert store.get(digest) == b"original"
    corrupt(store, digest, b"garbage")
    assert store.put_stream([b"orig", b"inal"]) == digest
    assert store.get(digest) == b"original"


def test_open_streams_and_verifies(store: FsBlobStore) -> None:
    data = os.urandom(5000)
    digest = store.put(data)
    with store.open(digest) as reader:
        assert reader.size == 5000
        chunks = list(reader)
        assert reader.verified
    assert [len(c) for c in chunks] == [1024, 1024, 1024, 1024, 904]
    assert b"".join(chunks) == data
    with store.open(digest) as reader:
        assert reader.read(10) == data[:10]
        assert not reader.verified
        assert reader.read() == data[10:]
        assert reader.verified


def test_open_raises_at_end_of_corrupt_blob(store: FsBlobStore) -> None:
    data = os.urandom(3000)
    digest = store.put(data)
    corrupt(store, digest, data[:2999] + bytes([data[2999] ^ 1]))
    received = []
    with store.open(digest) as reader, pytest.raises(CorruptBlob):  # noqa: PT012
        for chunk in reader:
            received.append(chunk)
    assert len(b"".join(received)) == 2048  # the last chunk is withheld


def test_missing_blob(store: FsBlobStore) -> None:
    digest = sha256_hex(b"never stored")
    assert not store.exists(digest)
    assert store.delete(digest) is False
    with pytest.raises(BlobNotFound):
        store.get(digest)
    with pytest.raises(BlobNotFound):
        store.open(digest)
    with pytest.raises(BlobNotFound):
        store.size(digest)


def test_delete(store: FsBlobStore) -> None:
    keep = store.put(b"keep")
    gone = store.put(b"gone")
    assert store.delete(gone) is True
    assert not store.exists(gone)
    assert list(store.iter_digests()) == [keep]


def test_iter_digests_skips_temp_and_foreign_files(store: FsBlobStore) -> None:
    digests = {store.put(bytes([i])) for i in range(20)}
    fan = store.path_of(next(iter(digests))).parent
    (fan / ".leftover.abc.tmp").write_bytes(b"")
    (store.root / "README").write_bytes(b"not a blob")
    assert set(store.iter_digests()) == digests


def test_cleanup_temp_removes_only_old_temps(store: FsBlobStore) -> None:
    digest = store.put(b"x")
    fan = store.path_of(digest).parent
    old = fan / ".old.1.tmp"
    fresh = store.root / ".incoming" / ".blob.2.tmp"
    old.write_bytes(b"")
    fresh.write_bytes(b"")
    os.utime(old, (1000.0, 1000.0))
    assert store.cleanup_temp(max_age_s=3600.0) == 1
    assert not old.exists()
    assert fresh.exists()
    assert store.exists(digest)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "../../etc/passwd",
        "ab/" + "0" * 61,
        "0" * 63,
        "0" * 65,
        "A" * 64,
        "g" * 64,
        "0" * 63 + "\n",
        "/" + "0" * 63,
        ".." + "0" * 62,
    ],
)
def test_invalid_digests_never_reach_the_filesystem(store: FsBlobStore, bad: str) -> None:
    for call in (store.get, store.open, store.exists, store.delete, store.size, store.path_of):
        with pytest.raises(InvalidDigest):
            call(bad)
    with pytest.raises(InvalidDigest):
        store.put(b"x", expected_digest=bad)
    with pytest.raises(InvalidDigest):
        store.put_stream([b"x"], expected_digest=bad)
    assert list(store.iter_digests()) == []


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=70))
def test_validate_digest_accepts_only_lowercase_sha256_hex(text: str) -> None:
    is_digest = len(text) == 64 and all(c in "0123456789abcdef" for c in text)
    if is_digest:
        assert validate_digest(text) == text
    else:
        with pytest.raises(InvalidDigest):
            validate_digest(text)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.binary(max_size=3000), max_size=5))
def test_round_trip_property(chunks: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = FsBlobStore(Path(tmp), chunk_size=512)
        data = b"".join(chunks)
        assert store.put_stream(chunks) == store.put(data) == sha256_hex(data)
        assert store.get(sha256_hex(data)) == data
        with store.open(sha256_hex(data)) as reader:
            assert b"".join(reader) == data


def test_chunk_size_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        FsBlobStore(tmp_path, chunk_size=0)
