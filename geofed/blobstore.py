"""Content-addressed blob store: sha256 hex digest -> bytes.

Blobs are immutable and named by the hash of their content, so a blob fetched from
any mirror can be checked without trusting it. :class:`BlobStore` is the interface (an
object store such as S3 can implement it later); :class:`FsBlobStore` keeps blobs on a
local filesystem under ``root/ab/cdef...`` (two-hex-digit fan-out), written with
temp + fsync + rename so a blob exists whole or not at all.

Digests are validated (exactly 64 lowercase hex characters) before they touch a path, so
no caller-supplied digest can escape the root. Every read is verified against the digest.
Blocking by design; asyncio daemons call it through a thread.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Protocol, Self, cast, runtime_checkable

from geofed.fsutil import StrPath, atomic_write_bytes, create_temp, fsync_dir, replace_durably

log = logging.getLogger(__name__)

_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
_INCOMING = ".incoming"
DEFAULT_CHUNK_SIZE = 1 << 20
Bytes = bytes | bytearray | memoryview


class BlobStoreError(Exception):
    """Base class of blob store errors."""


class InvalidDigest(BlobStoreError, ValueError):
    """A string is not a sha256 hex digest (64 lowercase hex characters)."""


class BlobNotFound(BlobStoreError, LookupError):
    """No blob with this digest is stored."""


class CorruptBlob(BlobStoreError):
    """A stored blob's content no longer hashes to its digest."""


class BlobDigestMismatch(BlobStoreError, ValueError):
    """Data offered to ``put`` does not hash to the digest the caller expected."""


def validate_digest(digest: str) -> str:
    """Return ``digest`` if it is 64 lowercase hex characters, else raise InvalidDigest."""
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise InvalidDigest(f"not a sha256 hex digest (64 lowercase hex characters): {digest!r}")
    return digest


def sha256_hex(data: Bytes) -> str:
    """The sha256 hex digest of ``data``."""
    return hashlib.sha256(data).hexdigest()


class BlobReader:
    """Streams one blob and verifies its digest when the end is reached.

    Bytes handed out before the end are not yet verified: a consumer must treat the
    content as untrusted until a read returns ``b""`` (or iteration stops) without
    raising :class:`CorruptBlob`.
    """

    def __init__(self, file: BinaryIO, digest: str, size: int, chunk_size: int) -> None:
        self._file = file
        self._digest = digest
        self._size = size
        self._chunk_size = chunk_size
        self._hash = hashlib.sha256()
        self._verified = False

    @property
    def digest(self) -> str:
        return self._digest

    @property
    def size(self) -> int:
        """Size of the blob when it was opened."""
        return self._size

    @property
    def verified(self) -> bool:
        """True once the whole blob was read and matched its digest."""
        return self._verified

    def read(self, n: int = -1) -> bytes:
        """Read up to ``n`` bytes (all remaining if negative); ``b""`` at the verified end."""
        data = self._file.read(n)
        self._hash.update(data)
        if n < 0 or len(data) < n:
            self._verify()
        return data

    def __iter__(self) -> Iterator[bytes]:
        while chunk := self.read(self._chunk_size):
            yield chunk

    def _verify(self) -> None:
        if self._verified:
            return
        actual = self._hash.hexdigest()
        if actual != self._digest:
            raise CorruptBlob(f"blob {self._digest} is corrupt: its content hashes to {actual}")
        self._verified = True

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@runtime_checkable
class BlobStore(Protocol):
    """A content-addressed store. Digests are sha256 hex; content is immutable."""

    def put(self, data: Bytes, *, expected_digest: str | None = None) -> str:
        """Store ``data`` (idempotent) and return its digest."""
        ...

    def put_stream(self, chunks: Iterable[bytes], *, expected_digest: str | None = None) -> str:
        """Store the concatenated ``chunks`` (idempotent) and return their digest."""
        ...

    def put_written(self, write: Callable[[BinaryIO], object]) -> str:
        """Store what ``write`` writes to the file it is handed (idempotent); return its
        digest. The content is hashed as it is written, never held in memory whole."""
        ...

    def get(self, digest: str) -> bytes:
        """The verified content of a blob."""
        ...

    def open(self, digest: str) -> BlobReader:
        """A streaming reader that verifies the digest at the end."""
        ...

    def exists(self, digest: str) -> bool: ...

    def delete(self, digest: str) -> bool:
        """Remove a blob; False if it was not there."""
        ...

    def size(self, digest: str) -> int: ...

    def iter_digests(self) -> Iterator[str]:
        """Every stored digest, in no particular order."""
        ...


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes what passes through it to ``file``."""

    def __init__(self, file: BinaryIO, hasher: Any) -> None:
        super().__init__()
        self._file = file
        self._hasher = hasher

    def writable(self) -> bool:
        return True

    def write(self, data: Bytes) -> int:  # type: ignore[override]
        written = self._file.write(data)
        # What the file took is what is hashed (a short write is retried by the caller).
        self._hasher.update(memoryview(data)[:written])
        return written

    def flush(self) -> None:
        self._file.flush()


class FsBlobStore:
    """A :class:`BlobStore` on a local filesystem directory.

    ``private`` (the default) makes directories 0700 and blobs 0600: blobs are model
    state derived from regions' data.
    """

    def __init__(
        self, root: StrPath, *, private: bool = True, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self._root = Path(root)
        self._private = private
        self._chunk_size = chunk_size
        self._dir_mode = 0o700 if private else 0o777
        self._root.mkdir(parents=True, exist_ok=True, mode=self._dir_mode)
        self._make_dir(self._root / _INCOMING)

    @property
    def root(self) -> Path:
        return self._root

    def path_of(self, digest: str) -> Path:
        """Where the blob with ``digest`` is written (whether or not it exists)."""
        validate_digest(digest)
        return self._root / digest[:2] / digest[2:]

    def read_path(self, digest: str) -> Path:
        """Where the blob with ``digest`` is read from: :meth:`path_of`, unless a store
        that also reads older blobs from elsewhere says otherwise."""
        return self.path_of(digest)

    def put(self, data: Bytes, *, expected_digest: str | None = None) -> str:
        digest = sha256_hex(data)
        _check_expected(digest, expected_digest)
        path = self.path_of(digest)
        if self._is_intact(path, digest):
            return digest
        self._make_dir(path.parent)
        atomic_write_bytes(path, data, private=self._private)
        return digest

    def put_stream(self, chunks: Iterable[bytes], *, expected_digest: str | None = None) -> str:
        def write(f: BinaryIO) -> None:
            for chunk in chunks:
                f.write(chunk)

        return self._put_hashed(write, expected_digest)

    def put_written(self, write: Callable[[BinaryIO], object]) -> str:
        return self._put_hashed(write, None)

    def adopt(self, path: Path, digest: str) -> None:
        """Make the file at ``path`` the blob ``digest`` by renaming it into the store: its
        bytes are written once. The caller hashed the file as it read it, and nothing
        writes to it any more. A blob already stored intact is kept and the file removed;
        across filesystems the file is copied (and checked against ``digest``) instead.
        The file is gone afterwards."""
        dest = self.path_of(digest)
        if self._is_intact(dest, digest):
            path.unlink(missing_ok=True)
            return
        self._make_dir(dest.parent)
        try:
            path.chmod(0o600 if self._private else 0o644)
            replace_durably(path, dest)
        except FileNotFoundError:
            # Another request finishing the same upload moved it first.
            if not self._is_intact(dest, digest):
                raise
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            with path.open("rb") as file:
                parts = iter(lambda: file.read(self._chunk_size), b"")
                self.put_stream(parts, expected_digest=digest)
            path.unlink(missing_ok=True)

    def _put_hashed(self, write: Callable[[BinaryIO], object], expected_digest: str | None) -> str:
        if expected_digest is not None:
            validate_digest(expected_digest)
        fd, tmp = create_temp(self._root / _INCOMING, "blob", private=self._private)
        try:
            hasher = hashlib.sha256()
            with os.fdopen(fd, "wb") as f:
                write(cast(BinaryIO, _HashingWriter(f, hasher)))
                f.flush()
                os.fsync(f.fileno())
            digest = hasher.hexdigest()
            _check_expected(digest, expected_digest)
            path = self.path_of(digest)
            if self._is_intact(path, digest):
                tmp.unlink()
                return digest
            self._make_dir(path.parent)
            replace_durably(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return digest

    def get(self, digest: str) -> bytes:
        path = self.read_path(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise BlobNotFound(f"no blob {digest} in {self._root}") from None
        actual = sha256_hex(data)
        if actual != digest:
            raise CorruptBlob(f"blob {digest} is corrupt: its content hashes to {actual}")
        return data

    def open(self, digest: str) -> BlobReader:
        path = self.read_path(digest)
        try:
            file = path.open("rb")
        except FileNotFoundError:
            raise BlobNotFound(f"no blob {digest} in {self._root}") from None
        size = os.fstat(file.fileno()).st_size
        return BlobReader(file, digest, size, self._chunk_size)

    def exists(self, digest: str) -> bool:
        return self.read_path(digest).is_file()

    def delete(self, digest: str) -> bool:
        path = self.path_of(digest)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        fsync_dir(path.parent)
        return True

    def size(self, digest: str) -> int:
        try:
            return self.read_path(digest).stat().st_size
        except FileNotFoundError:
            raise BlobNotFound(f"no blob {digest} in {self._root}") from None

    def iter_digests(self) -> Iterator[str]:
        for fan in sorted(self._root.iterdir()):
            if len(fan.name) != 2 or not fan.is_dir():
                continue
            for blob in sorted(fan.iterdir()):
                digest = fan.name + blob.name
                if _DIGEST_RE.fullmatch(digest):
                    yield digest

    def cleanup_temp(self, *, max_age_s: float = 3600.0, now: float | None = None) -> int:
        """Remove temp files older than ``max_age_s`` left by interrupted writes.

        Returns how many were removed. Younger ones may belong to a write in progress.
        """
        cutoff = (time.time() if now is None else now) - max_age_s
        removed = 0
        dirs = [self._root / _INCOMING]
        dirs += [d for d in self._root.iterdir() if len(d.name) == 2 and d.is_dir()]
        for directory in dirs:
            for entry in directory.glob(".*.tmp"):
                with contextlib.suppress(FileNotFoundError):
                    if entry.stat().st_mtime < cutoff:
                        entry.unlink()
                        removed += 1
        return removed

    def _is_intact(self, path: Path, digest: str) -> bool:
        """Whether a complete, correct copy is already stored; a corrupt one is replaced."""
        hasher = hashlib.sha256()
        try:
            with path.open("rb") as f:
                while chunk := f.read(self._chunk_size):
                    hasher.update(chunk)
        except FileNotFoundError:
            return False
        if hasher.hexdigest() == digest:
            return True
        log.warning("replacing corrupt blob %s", digest, extra={"blob_digest": digest})
        return False

    def _make_dir(self, path: Path) -> None:
        try:
            path.mkdir(mode=self._dir_mode)
        except FileExistsError:
            return
        fsync_dir(path.parent)

    def __repr__(self) -> str:
        return f"FsBlobStore({str(self._root)!r})"


def _check_expected(digest: str, expected: str | None) -> None:
    if expected is not None and validate_digest(expected) != digest:
        raise BlobDigestMismatch(f"data hashes to {digest}, expected {expected}")
