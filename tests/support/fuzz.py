"""Hypothesis strategies and mutations shared by the fuzz tests of untrusted input.

Byte mutations (edits, a cut, an appended tail) of a valid document, and structural ones
of a JSON document: a value set, dropped or added at one of its paths.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

Edit = tuple[int, int]
#: What :func:`edit_at` does at a path.
ACTIONS = ("set", "drop", "add")


def json_values(*, allow_nan: bool = True, text_size: int = 16) -> st.SearchStrategy[Any]:
    """Any JSON-like value: scalars (integers beyond 64 bits), lists and objects."""
    return st.recursive(
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.floats(allow_nan=allow_nan)
        | st.text(max_size=text_size),
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(st.text(max_size=8), children, max_size=4)
        ),
        max_leaves=12,
    )


def byte_edits(*, min_size: int = 0, max_size: int = 6) -> st.SearchStrategy[list[Edit]]:
    """(position, byte) pairs; a position is taken modulo the length of what it edits."""
    return st.lists(
        st.tuples(st.integers(min_value=0), st.integers(0, 255)),
        min_size=min_size,
        max_size=max_size,
    )


def mutated(
    data: bytes, edits: list[Edit], cut: int | None = None, tail: bytes = b"", keep: int = 0
) -> bytes:
    """``data`` with bytes replaced, cut short and extended, its first ``keep`` intact."""
    out = bytearray(data)
    span = len(out) - keep
    for position, value in edits:
        out[keep + position % span] = value
    if cut is not None:
        out = out[: keep + cut % (span + 1)]
    return bytes(out) + tail


def json_paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into ``value`` (keys and list positions), the empty one first."""
    found = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            found += json_paths(child, (*prefix, key))
    elif isinstance(value, list):
        for position, child in enumerate(value):
            found += json_paths(child, (*prefix, position))
    return found


def edit_at(document: Any, path: tuple[Any, ...], action: str, value: Any) -> None:
    """Set or drop what ``path`` names in ``document``, or add ``value`` beside it."""
    parent: Any = document
    for part in path[:-1]:
        parent = parent[part]
    key = path[-1]
    if action == "set":
        parent[key] = value
    elif action == "drop":
        del parent[key]
    elif isinstance(parent, dict):
        parent[f"{key}x"] = value
    else:
        parent.append(value)
