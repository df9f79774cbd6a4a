"""Where a region's data lies: a dataset location, its format, and the files it names.

A location is a directory, a single file or a glob; it is read only once absolute (an
agent config's relative paths are resolved first, :meth:`DatasetLocation.resolved`), so
that every rank of a region, whatever its working directory, reads the same files.
:func:`dataset_files` lists them in one order (sorted by path string), so every rank
sees the same dataset in the same order.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DataError", "DataFormat", "DatasetLocation", "dataset_files"]

DataFormat = Literal["parquet", "jsonl", "text", "tokens"]

#: The suffixes a directory scan picks for each format (compared case-insensitively).
_SUFFIXES: Final[dict[str, frozenset[str]]] = {
    "parquet": frozenset({".parquet"}),
    "jsonl": frozenset({".jsonl", ".json"}),
    "text": frozenset({".txt", ".md"}),
    "tokens": frozenset({".bin"}),
}
_GLOB_CHARS: Final = frozenset("*?[")


class DataError(Exception):
    """A dataset cannot be read; the message names the path or file and what is wrong."""


class DatasetLocation(BaseModel):
    """One dataset of a region: where its files are and how to read them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(description="a directory, file or glob (*, ?, [..], **)")
    format: DataFormat
    text_field: str = Field(
        default="text",
        min_length=1,
        description="parquet / jsonl: the column or key holding a document's text",
    )
    dtype: Literal["uint16", "uint32"] = Field(
        default="uint16",
        description="tokens: the element type of the flat .bin token files",
    )
    cache_dir: str | None = Field(
        default=None, description="the directory where tokenized text is cached"
    )

    def resolved(self, base: Path, default_cache_dir: Path) -> DatasetLocation:
        """This location with relative paths taken from ``base`` (a config file's
        directory) and ``cache_dir`` defaulting to ``default_cache_dir``."""

        def absolute(value: str) -> str:
            return value if Path(value).is_absolute() else str(base / value)

        cache = default_cache_dir if self.cache_dir is None else Path(absolute(self.cache_dir))
        return self.model_copy(update={"path": absolute(self.path), "cache_dir": str(cache)})


def _is_glob(path: str) -> bool:
    """Whether ``path`` is a glob pattern rather than a literal path."""
    return any(char in _GLOB_CHARS for char in path)


def dataset_files(location: DatasetLocation) -> list[Path]:
    """The location's files, sorted by path string.

    A directory gives every regular file below it whose suffix fits the format, skipping
    hidden files and directories (a name starting with '.': editors' swap files, ``.git``,
    half-written downloads); a file gives itself; a glob gives the files it matches,
    whatever their suffix, since the pattern already says which ones are meant.
    """
    pattern = location.path
    if not Path(pattern).is_absolute():
        # Every rank of a region must read the same files, whatever its working directory.
        raise DataError(f"dataset {pattern}: the path must be absolute")
    if _is_glob(pattern):
        # Path.glob takes only patterns relative to a directory; this one is absolute.
        matches = glob.glob(pattern, recursive=True)  # noqa: PTH207
        found = [Path(match) for match in matches]
        files = [path for path in found if path.is_file()]
    else:
        root = Path(pattern)
        if root.is_dir():
            files = _scan_directory(root, _SUFFIXES[location.format])
        elif root.is_file():
            files = [root]
        else:
            raise DataError(f"dataset {pattern}: no such file or directory")
    if not files:
        raise DataError(f"dataset {pattern}: matches no {location.format} files")
    return sorted(files, key=str)


def _scan_directory(root: Path, suffixes: frozenset[str]) -> list[Path]:
    files: list[Path] = []

    def refuse(error: OSError) -> None:
        # os.walk would skip an unreadable directory silently, and so train on less data.
        raise DataError(f"dataset {root}: cannot list {error.filename}: {error.strerror}")

    for directory, subdirs, names in os.walk(root, onerror=refuse):
        subdirs[:] = [name for name in subdirs if not name.startswith(".")]
        for name in names:
            path = Path(directory, name)
            if not name.startswith(".") and path.suffix.lower() in suffixes and path.is_file():
                files.append(path)
    return files
