"""The documents of a text dataset (parquet, jsonl or plain text), in file order."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

from geofed.data.location import DataError, DatasetLocation

__all__ = ["iter_documents"]

# Rows read at a time: documents can be large (whole books), so a batch of pyarrow's
# default 65,536 rows could need gigabytes.
_PARQUET_BATCH_ROWS: Final = 1024

_Reader = Callable[[Path, str], Iterator[str]]


def iter_documents(location: DatasetLocation, files: Sequence[Path]) -> Iterator[str]:
    """The documents of ``files`` (as :func:`~geofed.data.dataset_files` lists them), in order.

    parquet: the ``text_field`` column, null values skipped; jsonl: one JSON object per
    non-blank line, whose ``text_field`` must be a string; text: each file is one document
    (UTF-8). A ``tokens`` dataset has no documents: ValueError. Any problem reading a file
    raises :class:`DataError` naming it.
    """
    readers: dict[str, _Reader] = {"parquet": _parquet, "jsonl": _jsonl, "text": _text}
    reader = readers.get(location.format)
    if reader is None:  # raised at the call, where the mistake is, not at the first next()
        raise ValueError(f"a {location.format} dataset has no documents to read")
    return _chain(reader, files, location.text_field)


def _chain(reader: _Reader, files: Sequence[Path], field: str) -> Iterator[str]:
    for path in files:
        yield from reader(path, field)


def _pyarrow() -> Any:
    # Imported on first use: pyarrow comes with the hf extra, and only parquet needs it.
    try:
        return importlib.import_module("pyarrow.parquet"), importlib.import_module("pyarrow")
    except ImportError as exc:
        raise DataError(f"parquet needs pyarrow (pip install 'geofed[hf]'): {exc}") from None


def _parquet(path: Path, field: str) -> Iterator[str]:
    pq, pa = _pyarrow()
    try:
        with pq.ParquetFile(path) as parquet:
            schema: Any = parquet.schema_arrow
            if field not in schema.names:
                present = ", ".join(schema.names)
                raise DataError(f"{path}: no column {field!r} (columns: {present})")
            column_type = schema.field(field).type
            if not _is_text_type(pa, column_type):
                raise DataError(f"{path}: column {field!r} holds {column_type}, not strings")
            for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[field]):
                for text in batch.column(0).to_pylist():
                    if text is not None:
                        yield text
    except (OSError, pa.ArrowException) as error:
        raise DataError(f"{path}: cannot read parquet: {error}") from error


def _is_text_type(pa: Any, column_type: Any) -> bool:
    types = pa.types
    return bool(
        types.is_string(column_type)
        or types.is_large_string(column_type)
        or types.is_string_view(column_type)
    )


def _jsonl(path: Path, field: str) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    yield _json_text(path, number, line, field)
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not valid UTF-8 ({error.reason})") from error
    except OSError as error:
        raise DataError(f"{path}: cannot read: {error.strerror}") from error


def _json_text(path: Path, number: int, line: str, field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{number}: not JSON: {error.msg}") from error
    if not isinstance(record, dict):
        raise DataError(f"{path}:{number}: a JSON {_json_kind(record)}, not an object")
    if field not in record:
        raise DataError(f"{path}:{number}: no key {field!r}")
    text = record[field]
    if not isinstance(text, str):
        raise DataError(f"{path}:{number}: {field!r} is a JSON {_json_kind(text)}, not a string")
    return text


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return "array" if isinstance(value, list) else "object"


def _text(path: Path, field: str) -> Iterator[str]:
    del field  # a text file is one whole document
    try:
        data = path.read_bytes()
    except OSError as error:
        raise DataError(f"{path}: cannot read: {error.strerror}") from error
    try:
        yield data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not valid UTF-8 at byte {error.start}") from error
