"""Dataset locations: the model's checks and which files a location names, in what order."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from geofed.data import DataError, DatasetLocation, dataset_files


def naming(path: Path, message: str) -> str:
    """A pattern for an error message saying ``message`` about ``path``, literally."""
    return re.escape(f"{path}: {message}")


def touch(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_a_relative_path_is_not_read() -> None:
    with pytest.raises(DataError, match="path must be absolute"):
        dataset_files(DatasetLocation(path="data/train", format="parquet"))


def test_resolved_takes_relative_paths_from_the_base_and_defaults_the_cache(
    tmp_path: Path,
) -> None:
    relative = DatasetLocation(path="data/train", format="text", cache_dir="cache")
    resolved = relative.resolved(tmp_path, tmp_path / "state")
    assert resolved.path == str(tmp_path / "data" / "train")
    assert resolved.cache_dir == str(tmp_path / "cache")
    default = DatasetLocation(path="/data/*.txt", format="text").resolved(tmp_path, tmp_path / "s")
    assert default.path == "/data/*.txt"
    assert default.cache_dir == str(tmp_path / "s")


def test_unknown_keys_and_formats_are_refused_and_the_model_is_frozen() -> None:
    with pytest.raises(ValidationError):
        DatasetLocation(path="/data", format="parquet", columns="text")  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        DatasetLocation(path="/data", format="csv")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        DatasetLocation(path="/data", format="tokens", dtype="int64")  # type: ignore[arg-type]
    location = DatasetLocation(path="/data", format="jsonl")
    assert (location.text_field, location.dtype, location.cache_dir) == ("text", "uint16", None)
    with pytest.raises(ValidationError):
        location.path = "/elsewhere"


def test_directory_is_scanned_recursively_in_path_order(tmp_path: Path) -> None:
    wanted = [
        touch(tmp_path / "b" / "c" / "part-2.parquet"),
        touch(tmp_path / "a" / "part-9.parquet"),
        touch(tmp_path / "part-1.PARQUET"),
    ]
    touch(tmp_path / "notes.txt")
    touch(tmp_path / "part.parquet.tmp")
    location = DatasetLocation(path=str(tmp_path), format="parquet")
    assert dataset_files(location) == sorted(wanted, key=str)


def test_hidden_files_and_directories_are_skipped(tmp_path: Path) -> None:
    kept = touch(tmp_path / "shard" / "a.bin")
    touch(tmp_path / ".partial.bin")
    touch(tmp_path / ".git" / "objects" / "b.bin")
    touch(tmp_path / "shard" / ".cache" / "c.bin")
    assert dataset_files(DatasetLocation(path=str(tmp_path), format="tokens")) == [kept]


def test_hidden_directory_above_the_root_does_not_hide_it(tmp_path: Path) -> None:
    root = tmp_path / ".cache" / "corpus"
    kept = touch(root / "doc.md")
    assert dataset_files(DatasetLocation(path=str(root), format="text")) == [kept]


@pytest.mark.parametrize(
    ("data_format", "names"),
    [
        ("parquet", ["a.parquet"]),
        ("jsonl", ["b.json", "c.jsonl"]),
        ("text", ["d.md", "e.txt"]),
        ("tokens", ["f.bin"]),
    ],
)
def test_each_format_picks_its_suffixes(tmp_path: Path, data_format: str, names: list[str]) -> None:
    for name in ["a.parquet", "b.json", "c.jsonl", "d.md", "e.txt", "f.bin", "g.csv"]:
        touch(tmp_path / name)
    location = DatasetLocation.model_validate({"path": str(tmp_path), "format": data_format})
    assert dataset_files(location) == [tmp_path / name for name in names]


def test_glob_gives_the_matching_files_only(tmp_path: Path) -> None:
    wanted = [touch(tmp_path / "x" / "train-0.bin"), touch(tmp_path / "y" / "z" / "train-1.dat")]
    touch(tmp_path / "x" / "valid-0.bin")
    (tmp_path / "train-dir").mkdir()  # matches the pattern but is no file
    location = DatasetLocation(path=f"{tmp_path}/**/train-*", format="tokens")
    assert dataset_files(location) == sorted(wanted, key=str)


def test_single_file_is_itself_whatever_its_suffix(tmp_path: Path) -> None:
    path = touch(tmp_path / "corpus.dump")
    assert dataset_files(DatasetLocation(path=str(path), format="text")) == [path]


def test_a_directory_without_files_of_the_format_is_an_error(tmp_path: Path) -> None:
    touch(tmp_path / "doc.txt")
    with pytest.raises(DataError, match=naming(tmp_path, "matches no jsonl files")):
        dataset_files(DatasetLocation(path=str(tmp_path), format="jsonl"))


def test_a_glob_matching_nothing_is_an_error(tmp_path: Path) -> None:
    pattern = f"{tmp_path}/*.parquet"
    with pytest.raises(DataError, match="matches no parquet files"):
        dataset_files(DatasetLocation(path=pattern, format="parquet"))


def test_a_missing_path_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match=naming(missing, "no such file or directory")):
        dataset_files(DatasetLocation(path=str(missing), format="text"))
