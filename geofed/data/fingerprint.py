"""A dataset's fingerprint: which files it holds, how large, and a sample of their content.

The fingerprint is what a region says about its data off the region (in its deltas'
signed manifests, the lineage and the audit log): a sha256 over each file's path relative
to the dataset's root, its size, and the sha256 of its first and last MiB. It changes
when a file is added, removed, renamed, grown, truncated or rewritten at either end; it
never reveals a path or a byte of content, and costs two reads per file whatever the
dataset's size (an edit confined to the middle of a file larger than 2 MiB keeps it).
Each file's part is kept per process by path, size and modification time.
"""

from __future__ import annotations

import glob
import hashlib
from pathlib import Path

from geofed.data.location import DataError, DatasetLocation, dataset_files

__all__ = ["SAMPLE_BYTES", "dataset_fingerprint"]

#: Bytes hashed at each end of every file.
SAMPLE_BYTES = 1 << 20
_KNOWN: dict[tuple[str, int, int], str] = {}


def dataset_fingerprint(location: DatasetLocation) -> str:
    """The fingerprint of the dataset at ``location`` (see the module docstring)."""
    files = dataset_files(location)
    root = _root(location)
    total = hashlib.sha256()
    for path in files:
        try:
            relative = path.relative_to(root).as_posix()
            total.update(f"{relative}\0{_sampled(path)}\n".encode())
        except OSError as exc:
            raise DataError(f"dataset {location.path}: cannot read {path}: {exc}") from None
    return total.hexdigest()


def _root(location: DatasetLocation) -> Path:
    """What file paths are taken relative to: the directory, the file's directory, or the
    part of a glob before its first wildcard."""
    path = Path(location.path)
    if glob.has_magic(location.path):
        parts = path.parts
        for index, part in enumerate(parts):
            if glob.has_magic(part):
                return Path(*parts[:index])
    return path if path.is_dir() else path.parent


def _sampled(path: Path) -> str:
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    known = _KNOWN.get(key)
    if known is None:
        digest = hashlib.sha256(str(stat.st_size).encode() + b"\0")
        with path.open("rb") as file:
            digest.update(file.read(SAMPLE_BYTES))
            if stat.st_size > SAMPLE_BYTES:
                file.seek(max(SAMPLE_BYTES, stat.st_size - SAMPLE_BYTES))
                digest.update(file.read(SAMPLE_BYTES))
        known = _KNOWN[key] = digest.hexdigest()
    return known
