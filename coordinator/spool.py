"""The durable spool of delta uploads in progress.

One directory per open upload, ``<root>/<job>/<round>/<region>/<manifest digest>/``,
holding the signed manifest and each received frame (``chunk-<index>``), every file
written temp + fsync + rename and every new directory fsynced into its parent, so a
chunk acknowledged to a region survives a crash. Frames are written in two steps so that
concurrent ones share the directory fsync: :meth:`Spool.stage_chunk` writes and fsyncs a
temp file (in parallel, one per request), :meth:`Spool.publish_chunks` renames a batch
into place and fsyncs each directory once. Once the delta is accepted its stream
lives in the blob store and the region's spool directory is removed. Blocking: call from
a worker thread. Path parts are validated names and digests, never raw client text.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from geofed.blobstore import validate_digest
from geofed.fsutil import atomic_write_bytes, create_temp, fsync_dir
from geofed.types import validate_name

__all__ = ["Spool", "StagedChunk"]

_MANIFEST = "manifest"


@dataclass(frozen=True, slots=True)
class StagedChunk:
    """A frame written and fsync'd under a temp name, not yet in place."""

    temp: Path
    final: Path


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

    def stage_chunk(
        self, job: str, round: int, region: str, digest: str, index: int, data: bytes
    ) -> StagedChunk:
        """Write ``data`` to a temp file beside its frame's place and fsync it."""
        directory = self._make(self.upload_dir(job, round, region, digest))
        fd, temp = create_temp(directory, f"chunk-{index}", private=True)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        return StagedChunk(temp, directory / f"chunk-{index}")

    @staticmethod
    def publish_chunks(staged: Sequence[StagedChunk]) -> list[OSError | None]:
        """Rename staged frames into place, then fsync each directory once.

        One outcome per frame: None once it is durable in place, else the error (its
        upload directory vanished, the disk failed).
        """
        outcomes: list[OSError | None] = []
        directories: dict[Path, list[int]] = {}
        for position, chunk in enumerate(staged):
            try:
                chunk.temp.replace(chunk.final)
            except OSError as exc:
                outcomes.append(exc)
                continue
            outcomes.append(None)
            directories.setdefault(chunk.final.parent, []).append(position)
        for directory, members in directories.items():
            try:
                fsync_dir(directory)
            except OSError as exc:
                for position in members:
                    outcomes[position] = exc
        return outcomes

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
