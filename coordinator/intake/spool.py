"""The durable spool of delta uploads in progress.

One directory per open upload, ``<root>/<job>/<round>/<region>/<manifest digest>/``,
holding the signed manifest and the stream itself (``stream``): the file is created empty
with the manifest (file and directory fsynced), and each received frame is written at its
offset (the sizes of the frames before it, from the manifest) and fdatasync'd before it is
acknowledged, so a chunk acknowledged to a region survives a crash; frames arriving
together are written in parallel, each at its own place. Once the delta is checked, the
file itself becomes the delta's blob (:meth:`geofed.blobstore.FsBlobStore.adopt`, a
rename): the stream is written once. Blocking: call from a worker thread. Path parts are
validated names and digests, never raw client text.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from geofed.blobstore import validate_digest
from geofed.fsutil import atomic_write_bytes, fsync_dir
from geofed.types import validate_name

__all__ = ["Spool"]

_MANIFEST = "manifest"
_STREAM = "stream"


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

    def save_manifest(self, job: str, round: int, region: str, digest: str, data: bytes) -> bool:
        """Keep the upload's manifest, and create its empty stream file unless it exists (a
        manifest sent again keeps the frames already received); True when the file was
        created now, so that no frame of the upload is on disk."""
        directory = self._make(self.upload_dir(job, round, region, digest))
        stream = directory / _STREAM
        created = not stream.exists()
        if created:
            fd = os.open(stream, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            os.close(fd)
        # Its directory is fsynced with the manifest's rename, the stream's entry with it.
        atomic_write_bytes(directory / _MANIFEST, data, private=True)
        return created

    def load_manifest(self, job: str, round: int, region: str, digest: str) -> bytes | None:
        path = self.upload_dir(job, round, region, digest) / _MANIFEST
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    def stream_path(self, job: str, round: int, region: str, digest: str) -> Path:
        """The upload's stream file (its frames at their offsets)."""
        return self.upload_dir(job, round, region, digest) / _STREAM

    def write_chunk(
        self, job: str, round: int, region: str, digest: str, offset: int, data: bytes
    ) -> None:
        """Write a frame at ``offset`` of the upload's stream and make it durable;
        ``FileNotFoundError`` when the upload is gone (its manifest was never kept, or the
        upload was finished or discarded meanwhile)."""
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        path = self.stream_path(job, round, region, digest)
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            view = memoryview(data)
            while view:
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written
            os.fdatasync(fd)
        finally:
            os.close(fd)

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
