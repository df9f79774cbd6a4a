"""The durable spool of delta uploads in progress.

One directory per open upload, ``<root>/<job>/<round>/<region>/<manifest digest>/``,
holding the signed manifest and each received frame (``chunk-<index>``), every file
written temp + fsync + rename and every new directory fsynced into its parent, so a
chunk acknowledged to a region survives a crash. Once the delta is accepted its stream
lives in the blob store and the region's spool directory is removed. Blocking: call from
a worker thread. Path parts are validated names and digests, never raw client text.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

from geofed.blobstore import validate_digest
from geofed.fsutil import atomic_write_bytes, fsync_dir
from geofed.types import validate_name

__all__ = ["Spool"]

_MANIFEST = "manifest"


class Spool:
    """Spooled uploads under ``root`` (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def upload_dir(self, job: str, round: int, region: str, digest: str) -> Path:
        validate_name("job", job)
        validate_name("region", region)
        validate_digest(digest)
        if round < 0:
            raise ValueError(f"round must be >= 0, got {round}")
        return self._root / job / str(round) / region / digest

    def save_manifest(self, job: str, round: int, region: str, digest: str, data: bytes) -> None:
        directory = self._make(self.upload_dir(job, round, region, digest))
        atomic_write_bytes(directory / _MANIFEST, data, private=True)

    def load_manifest(self, job: str, round: int, region: str, digest: str) -> bytes | None:
        path = self.upload_dir(job, round, region, digest) / _MANIFEST
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    def save_chunk(
        self, job: str, round: int, region: str, digest: str, index: int, data: bytes
    ) -> None:
        directory = self._make(self.upload_dir(job, round, region, digest))
        atomic_write_bytes(directory / f"chunk-{index}", data, private=True)

    def frames(self, job: str, round: int, region: str, digest: str, count: int) -> Iterator[bytes]:
        """The spooled frames 0..count-1 in order, one file at a time."""
        directory = self.upload_dir(job, round, region, digest)
        for index in range(count):
            yield (directory / f"chunk-{index}").read_bytes()

    def discard(self, job: str, round: int, region: str) -> None:
        """Remove every spooled upload of a region for a round."""
        validate_name("job", job)
        validate_name("region", region)
        self._remove(self._root / job / str(round) / region)

    def discard_round(self, job: str, round: int) -> None:
        """Remove every spooled upload of a round (once it is published)."""
        validate_name("job", job)
        self._remove(self._root / job / str(round))

    @staticmethod
    def _remove(directory: Path) -> None:
        # Two requests may finish the same upload at once; the second finds nothing left.
        try:
            shutil.rmtree(directory)
        except FileNotFoundError:
            return
        fsync_dir(directory.parent)

    def _make(self, directory: Path) -> Path:
        """Create ``directory`` and its missing parents, each fsynced into its parent."""
        missing = []
        path = directory
        while not path.exists():
            missing.append(path)
            path = path.parent
        for path in reversed(missing):
            path.mkdir(mode=0o700, exist_ok=True)
            fsync_dir(path.parent)
        return directory
