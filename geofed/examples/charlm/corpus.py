"""The character-LM corpus: Python source files, split into non-IID region groups.

Files are grouped into *units*, one per top-level package or module of the corpus root
(``asyncio``, ``json``, ``os``...). Whole units are assigned to region groups, so each
region sees different code. About one file in :data:`VALIDATION_MODULUS`, chosen by a
stable hash of its path, is held out of every group and forms the shared validation
split. Everything is a pure function of the files, so every process that reads the
same tree agrees on groups and validation split byte for byte.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

#: Directories never read: installed third-party code and test suites (which include
#: deliberately malformed files and would dwarf the rest).
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)

#: A file is held out for validation when ``stable_hash("val:" + path) % VALIDATION_MODULUS == 0``.
VALIDATION_MODULUS = 20


class CorpusError(Exception):
    """The corpus cannot be read or cannot be split as asked."""


def stable_hash(text: str) -> int:
    """Return a 64-bit hash of ``text`` that is the same in every process and run."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little")


def is_validation_file(relpath: str) -> bool:
    """Return whether the file at ``relpath`` (POSIX, relative to the root) is held out."""
    return stable_hash("val:" + relpath) % VALIDATION_MODULUS == 0


def unit_of(relpath: str) -> str:
    """Return the top-level package or module a relative path belongs to."""
    top = relpath.split("/", 1)[0]
    return top.removesuffix(".py")


@dataclass(frozen=True, slots=True)
class CorpusUnit:
    """One top-level package or module: its training files and their concatenated bytes."""

    name: str
    files: tuple[str, ...]
    data: bytes


@dataclass(frozen=True, slots=True)
class Corpus:
    """Training units (sorted by name, none empty) and the shared validation split."""

    root: Path
    units: tuple[CorpusUnit, ...]
    validation_files: tuple[str, ...]
    validation: bytes
    fingerprint: str

    def assign_groups(self, num_groups: int) -> tuple[tuple[str, ...], ...]:
        """Return the unit names of each of ``num_groups`` groups.

        Largest units first, each to the group with the fewest bytes so far (ties to the
        lowest index): deterministic, and balanced so that no region starves.
        """
        if num_groups < 1:
            raise CorpusError(f"num_groups must be >= 1, got {num_groups}")
        if num_groups > len(self.units):
            raise CorpusError(
                f"cannot split {len(self.units)} corpus units into {num_groups} groups"
            )
        sizes = [0] * num_groups
        members: list[list[str]] = [[] for _ in range(num_groups)]
        for unit in sorted(self.units, key=lambda u: (-len(u.data), u.name)):
            target = min(range(num_groups), key=lambda g: (sizes[g], g))
            sizes[target] += len(unit.data)
            members[target].append(unit.name)
        return tuple(tuple(sorted(names)) for names in members)

    def group_data(self, group_index: int, num_groups: int) -> bytes:
        """Return the training bytes of one group: its units' data in name order."""
        if not 0 <= group_index < num_groups:
            raise CorpusError(f"group_index must be in [0, {num_groups}), got {group_index}")
        names = set(self.assign_groups(num_groups)[group_index])
        return b"".join(unit.data for unit in self.units if unit.name in names)


def default_root() -> Path:
    """Return the running Python's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def _list_files(root: Path) -> list[str]:
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorted in place so the walk order, and thus the corpus, never depends on the
        # file system's directory order.
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        for filename in sorted(filenames):
            if filename.endswith(".py"):
                found.append(filename if rel_dir == "." else f"{rel_dir}/{filename}")
    return sorted(found)


def scan_corpus(root: Path) -> Corpus:
    """Read every ``.py`` file under ``root`` (outside :data:`EXCLUDED_DIRS`) into a corpus."""
    if not root.is_dir():
        raise CorpusError(f"corpus root {str(root)!r} is not a directory")
    train_files: dict[str, list[str]] = {}
    train_data: dict[str, list[bytes]] = {}
    val_files: list[str] = []
    val_parts: list[bytes] = []
    digest = hashlib.sha256()
    for relpath in _list_files(root):
        try:
            content = (root / relpath).read_bytes()
        except OSError as exc:
            raise CorpusError(f"cannot read corpus file {str(root / relpath)!r}: {exc}") from exc
        if not content:
            continue
        digest.update(relpath.encode("utf-8") + b"\0" + hashlib.sha256(content).digest())
        if is_validation_file(relpath):
            val_files.append(relpath)
            val_parts.append(content)
        else:
            unit = unit_of(relpath)
            train_files.setdefault(unit, []).append(relpath)
            train_data.setdefault(unit, []).append(content)
    units = tuple(
        CorpusUnit(name=name, files=tuple(train_files[name]), data=b"".join(train_data[name]))
        for name in sorted(train_files)
    )
    if not units:
        raise CorpusError(f"no training files (*.py) under {str(root)!r}")
    if not val_parts:
        raise CorpusError(f"no validation files under {str(root)!r}: the corpus is too small")
    return Corpus(
        root=root,
        units=units,
        validation_files=tuple(val_files),
        validation=b"".join(val_parts),
        fingerprint=digest.hexdigest(),
    )


@functools.lru_cache(maxsize=4)
def _load_cached(root: str) -> Corpus:
    return scan_corpus(Path(root))


def load_corpus(root: Path | None = None) -> Corpus:
    """Return the corpus under ``root`` (default: the standard library), read once per process.

    The standard library (about 12 MB in 700 files) reads in well under a second from
    a warm page cache, so there is no on-disk cache to keep consistent.
    """
    resolved = (default_root() if root is None else root).resolve()
    return _load_cached(str(resolved))
