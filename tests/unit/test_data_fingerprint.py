"""A dataset's fingerprint: it follows the files, their sizes and both ends of their
content, not where the dataset lies."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from geofed.data import DataError, DatasetLocation, dataset_fingerprint
from geofed.data.fingerprint import SAMPLE_BYTES


def dataset(root: Path) -> DatasetLocation:
    (root / "a").mkdir(parents=True)
    (root / "a" / "one.jsonl").write_text('{"text": "one"}\n')
    (root / "two.jsonl").write_bytes(b"x" * (3 * SAMPLE_BYTES))
    return DatasetLocation(path=str(root), format="jsonl")


def touch_later(path: Path) -> None:
    # The cache is keyed by modification time: make an edit within the same tick visible.
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))


def test_the_same_files_elsewhere_have_the_same_fingerprint(tmp_path: Path) -> None:
    here = dataset(tmp_path / "here")
    first = dataset_fingerprint(here)
    assert len(first) == 64
    shutil.copytree(tmp_path / "here", tmp_path / "there")
    assert (
        dataset_fingerprint(DatasetLocation(path=str(tmp_path / "there"), format="jsonl")) == first
    )
    by_glob = DatasetLocation(path=str(tmp_path / "here" / "**" / "*.jsonl"), format="jsonl")
    assert dataset_fingerprint(by_glob) == first


@pytest.mark.parametrize("change", ["add", "remove", "rename", "grow", "head", "tail"])
def test_a_change_to_the_files_changes_it(tmp_path: Path, change: str) -> None:
    location = dataset(tmp_path / "d")
    before = dataset_fingerprint(location)
    big = tmp_path / "d" / "two.jsonl"
    if change == "add":
        (tmp_path / "d" / "three.jsonl").write_text("{}\n")
    elif change == "remove":
        (tmp_path / "d" / "a" / "one.jsonl").unlink()
    elif change == "rename":
        (tmp_path / "d" / "a" / "one.jsonl").rename(tmp_path / "d" / "a" / "uno.jsonl")
    elif change == "grow":
        with big.open("ab") as file:
            file.write(b"x")
    else:
        with big.open("r+b") as file:
            file.seek(0 if change == "head" else 3 * SAMPLE_BYTES - 1)
            file.write(b"y")
        touch_later(big)
    assert dataset_fingerprint(location) != before


def test_an_edit_in_the_middle_of_a_large_file_is_not_seen(tmp_path: Path) -> None:
    location = dataset(tmp_path / "d")
    before = dataset_fingerprint(location)
    big = tmp_path / "d" / "two.jsonl"
    with big.open("r+b") as file:
        file.seek(SAMPLE_BYTES + SAMPLE_BYTES // 2)
        file.write(b"y")
    touch_later(big)
    assert dataset_fingerprint(location) == before  # as documented: a sample, not a hash


def test_a_dataset_without_files_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file or directory"):
        dataset_fingerprint(DatasetLocation(path=str(tmp_path / "none"), format="text"))
