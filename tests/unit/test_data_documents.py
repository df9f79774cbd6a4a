"""Reading a text dataset's documents: parquet, JSON lines and text files, and bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from geofed.data import DataError, DatasetLocation, iter_documents


def naming(path: Path, message: str) -> str:
    """A pattern for an error message saying ``message`` about ``path``, literally."""
    return re.escape(f"{path}: {message}")


def write_parquet(path: Path, columns: dict[str, list[object]], row_group_size: int = 2) -> Path:
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def location(root: Path, data_format: str, text_field: str = "text") -> DatasetLocation:
    return DatasetLocation.model_validate(
        {"path": str(root), "format": data_format, "text_field": text_field}
    )


def test_parquet_documents_in_file_order_with_nulls_skipped(tmp_path: Path) -> None:
    first = write_parquet(
        tmp_path / "0.parquet",
        {"id": [1, 2, 3, 4, 5], "content": ["a", None, "b", "c", "é"]},
    )
    second = write_parquet(tmp_path / "1.parquet", {"content": ["d"]})
    docs = iter_documents(location(tmp_path, "parquet", "content"), [first, second])
    assert list(docs) == ["a", "b", "c", "é", "d"]


def test_parquet_without_the_column_names_file_column_and_columns(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "0.parquet", {"body": ["a"], "url": ["u"]})
    with pytest.raises(DataError, match=naming(path, "no column 'text' (columns: body, url)")):
        list(iter_documents(location(tmp_path, "parquet"), [path]))


def test_parquet_column_of_numbers_is_an_error(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "0.parquet", {"text": [1, 2]})
    with pytest.raises(DataError, match=naming(path, "column 'text' holds int64, not strings")):
        list(iter_documents(location(tmp_path, "parquet"), [path]))


def test_a_file_that_is_not_parquet_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "0.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=naming(path, "cannot read parquet")):
        list(iter_documents(location(tmp_path, "parquet"), [path]))


def test_jsonl_documents_skip_blank_lines(tmp_path: Path) -> None:
    first = write_jsonl(
        tmp_path / "a.jsonl",
        [json.dumps({"text": "one", "n": 1}), "", "   ", json.dumps({"text": "two\nlines"})],
    )
    second = write_jsonl(tmp_path / "b.json", [json.dumps({"text": "three"})])
    docs = iter_documents(location(tmp_path, "jsonl"), [first, second])
    assert list(docs) == ["one", "two\nlines", "three"]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ('{"text": 7}', "'text' is a JSON number, not a string"),
        ('{"text": null}', "'text' is a JSON null, not a string"),
        ('{"text": ["a"]}', "'text' is a JSON array, not a string"),
        ('{"body": "x"}', "no key 'text'"),
        ('["text"]', "a JSON array, not an object"),
        ('{"text": ', "not JSON"),
    ],
)
def test_jsonl_bad_record_names_file_and_line(tmp_path: Path, record: str, message: str) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", ['{"text": "fine"}', "", record])
    docs = iter_documents(location(tmp_path, "jsonl"), [path])
    assert next(docs) == "fine"
    with pytest.raises(DataError, match="^" + re.escape(f"{path}:3: {message}")):
        next(docs)


def test_jsonl_bad_utf8_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "\xff"}\n')
    with pytest.raises(DataError, match=naming(path, "not valid UTF-8")):
        list(iter_documents(location(tmp_path, "jsonl"), [path]))


def test_each_text_file_is_one_document(tmp_path: Path) -> None:
    first, second = tmp_path / "a.txt", tmp_path / "b.md"
    first.write_text("line one\nline two\n", encoding="utf-8")
    second.write_text("# Title\n", encoding="utf-8")
    docs = iter_documents(location(tmp_path, "text"), [first, second])
    assert list(docs) == ["line one\nline two\n", "# Title\n"]


def test_text_bad_utf8_names_file_and_byte(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_bytes(b"ok \xc3\x28")
    with pytest.raises(DataError, match=naming(path, "not valid UTF-8 at byte 3")):
        list(iter_documents(location(tmp_path, "text"), [path]))


def test_token_datasets_have_no_documents(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokens dataset has no documents"):
        iter_documents(location(tmp_path, "tokens"), [])
