"""Full disks for tests: a small tmpfs mounted for a test (a real filesystem that really
runs out of space; mounting needs root, which this project's machines are) and a file that
fills it."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ENOSPC_TEXT = os.strerror(errno.ENOSPC)  # "No space left on device"
PAGE = 4096  # tmpfs allocates whole pages


@contextmanager
def tmpfs(path: Path, size: str = "1m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted on ``path`` for the block (needs root)."""
    path.mkdir(parents=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"cannot mount a tmpfs (root needed): {result.stderr}"
    try:
        yield path
    finally:
        # Lazy: a failing test may still hold a file open; the mount must not outlive it.
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def fill(directory: Path) -> Path:
    """Write a file into ``directory`` until its filesystem has no block left."""
    filler = directory / "filler"
    block = b"\xa5" * PAGE
    with filler.open("wb", buffering=0) as file:
        while True:
            try:
                file.write(block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    assert os.statvfs(directory).f_bavail == 0
    return filler
