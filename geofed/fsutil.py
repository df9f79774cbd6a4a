"""Crash-safe file writes: temp file, fsync, rename, fsync of the directory.

A reader of ``path`` sees either the complete old content or the complete new content,
never a torn mix, even if the process dies or the machine loses power mid-write (the
ALICE study, OSDI'14, found 60 crash bugs in 11 systems that skipped one of these steps).
On any error the temporary file is removed and the old file is left untouched. The temp
file is created with the file's final mode (``private``: exactly 0600), so a key is never
readable by others, not even briefly.

These functions block on disk I/O by design; asyncio daemons call them through a thread
(``asyncio.to_thread`` or an executor).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

StrPath = str | os.PathLike[str]
FdOpener = Callable[[int], BinaryIO]
"""Wraps a raw file descriptor into a binary writer; the default is ``os.fdopen(fd, "wb")``."""

PRIVATE_MODE = 0o600
#: Certificates, trust bundles and other files anyone may read (the umask may narrow it).
PUBLIC_MODE = 0o644
_DEFAULT_MODE = 0o666  # narrowed by the process umask, like open()
_TEMP_SUFFIX = ".tmp"


def _default_fdopen(fd: int) -> BinaryIO:
    return os.fdopen(fd, "wb")


def fsync_dir(path: StrPath) -> None:
    """Flush a directory's entries (creations, renames, deletions) to stable storage."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_mode(private: bool, mode: int | None) -> int:
    if mode is None:
        return PRIVATE_MODE if private else _DEFAULT_MODE
    if private:
        raise ValueError("private and mode exclude each other (private means mode 0600)")
    return mode


def create_temp(
    directory: StrPath, stem: str, *, private: bool = False, mode: int | None = None
) -> tuple[int, Path]:
    """Create a new, empty, uniquely named hidden temp file in ``directory``.

    Returns the open write-only descriptor and its path. The name starts with a dot and
    ends in ``.tmp`` so directory scans can skip it. ``private`` forces mode 0600;
    ``mode`` is the mode to create it with otherwise (default 0666), narrowed by the umask.
    """
    file_mode = _file_mode(private, mode)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = Path(directory) / f".{stem}.{secrets.token_hex(6)}{_TEMP_SUFFIX}"
        try:
            fd = os.open(tmp, flags, file_mode)
        except FileExistsError:
            continue
        if private:
            try:
                os.fchmod(fd, PRIVATE_MODE)  # the umask may have removed bits; make it exact
            except BaseException:
                os.close(fd)
                tmp.unlink(missing_ok=True)
                raise
        return fd, tmp
    raise FileExistsError(errno.EEXIST, "could not pick an unused temp file name", str(directory))


def replace_durably(src: StrPath, dst: StrPath) -> None:
    """Rename ``src`` over ``dst`` and fsync the directories involved."""
    src_path, dst_path = Path(src), Path(dst)
    src_path.replace(dst_path)
    fsync_dir(dst_path.parent)
    if src_path.parent.resolve() != dst_path.parent.resolve():
        fsync_dir(src_path.parent)


class AtomicFile:
    """Context manager that atomically replaces ``path`` with what is written inside it.

    ``with AtomicFile(path) as f: f.write(...)`` writes to a temp file in the same
    directory; on a clean exit it flushes and fsyncs the file, renames it over ``path``
    and fsyncs the directory. If the block (or any step) raises, the temp file is
    removed, ``path`` keeps its old content, and the exception propagates.

    ``private`` and ``mode`` are those of :func:`create_temp`. ``durable=False`` skips
    both fsyncs, for advisory files rewritten often: a reader still never sees a torn
    file, but a crash may lose the latest version. ``fdopen`` wraps the temp file's
    descriptor; it exists so tests can put a faulty disk under the writer.
    """

    def __init__(
        self,
        path: StrPath,
        *,
        private: bool = False,
        mode: int | None = None,
        durable: bool = True,
        fdopen: FdOpener = _default_fdopen,
    ) -> None:
        _file_mode(private, mode)  # refuse a contradiction here, not at __enter__
        self._path = Path(path)
        self._private = private
        self._mode = mode
        self._durable = durable
        self._fdopen = fdopen
        self._file: BinaryIO | None = None
        self._tmp: Path | None = None

    @property
    def path(self) -> Path:
        """The target path."""
        return self._path

    @property
    def temp_path(self) -> Path | None:
        """The temp file being written, while the context is open."""
        return self._tmp

    def __enter__(self) -> BinaryIO:
        if self._file is not None:
            raise RuntimeError(f"AtomicFile for {self._path} is already open")
        parent = self._path.parent
        fd, tmp = create_temp(parent, self._path.name, private=self._private, mode=self._mode)
        try:
            self._file = self._fdopen(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        self._tmp = tmp
        return self._file

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        file, tmp = self._file, self._tmp
        self._file = None
        self._tmp = None
        if file is None or tmp is None:
            return
        if exc_type is not None:
            _discard(file, tmp)
            return
        try:
            file.flush()
            if self._durable:
                os.fsync(file.fileno())
            file.close()
            if self._durable:
                replace_durably(tmp, self._path)
            else:
                tmp.replace(self._path)
        except BaseException:
            _discard(file, tmp)
            raise

    def __repr__(self) -> str:
        return f"AtomicFile({str(self._path)!r})"


def _discard(file: BinaryIO, tmp: Path) -> None:
    """Close and remove a temp file after a failure, keeping the original error."""
    # Closing flushes; a full disk fails again here, and that failure is already reported.
    with contextlib.suppress(OSError):
        file.close()
    tmp.unlink(missing_ok=True)


def atomic_write_bytes(
    path: StrPath,
    data: bytes | bytearray | memoryview,
    *,
    private: bool = False,
    mode: int | None = None,
    durable: bool = True,
) -> None:
    """Atomically replace ``path`` with ``data`` (durable when this returns).

    ``private``, ``mode`` and ``durable`` are those of :class:`AtomicFile`.
    """
    with AtomicFile(path, private=private, mode=mode, durable=durable) as f:
        f.write(data)


def atomic_write_stream(path: StrPath, chunks: Iterable[bytes], *, private: bool = False) -> int:
    """Atomically replace ``path`` with the concatenated ``chunks``; return bytes written.

    If the iterable raises midway, nothing is replaced and the temp file is removed.
    """
    total = 0
    with AtomicFile(path, private=private) as f:
        for chunk in chunks:
            f.write(chunk)
            total += len(chunk)
    return total
