"""Crash-safe file writes with the right permissions from the first byte.

A file is written under a temporary name created with its final mode (``0600`` for
private keys, so a key is never readable by others, not even briefly), fsynced, renamed
over the target, and the directory is fsynced, so a crash leaves the old file or the new
one, never a torn one.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

PRIVATE_MODE = 0o600
PUBLIC_MODE = 0o644


def write_file_atomic(path: Path, data: bytes, *, mode: int) -> None:
    """Write ``data`` to ``path`` (replacing it) through a temp file created with ``mode``."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
