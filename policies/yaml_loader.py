"""YAML loading that remembers where every key came from.

:func:`load_located` parses one YAML document into plain Python data plus a
:class:`LineMap` from key paths (``("exports", "raw_data", 0, "to")``) to 1-based line
numbers, so later validation errors can point at the exact line. Duplicate keys, merge
keys, recursive aliases and oversized documents are errors rather than silent surprises.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from policies.errors import PolicyLoadError, Problem

KeyPath = tuple[str | int, ...]

# Policy files are small and written by people; these bounds stop alias bombs early.
MAX_DOCUMENT_BYTES = 1 << 20
MAX_NODES = 100_000

_BOOL_TAG = "tag:yaml.org,2002:bool"
_PLAIN_COLLECTION_TAGS = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans: ``NO`` (Norway) and ``on`` stay strings."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def format_key_path(path: KeyPath) -> str:
    """``("exports", "raw_data", 0, "to")`` -> ``exports.raw_data[0].to``."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "(document)"


@dataclass(frozen=True, slots=True)
class LineMap:
    """1-based line of every mapping key and sequence item, by key path."""

    lines: Mapping[KeyPath, int]

    def line_of(self, path: KeyPath) -> int:
        """Line of ``path``, or of its nearest recorded ancestor (a missing key's parent)."""
        for end in range(len(path), -1, -1):
            line = self.lines.get(path[:end])
            if line is not None:
                return line
        return 1


@dataclass(frozen=True, slots=True)
class LocatedDocument:
    data: object
    lines: LineMap


def load_located(text: str, file: str) -> LocatedDocument:
    """Parse one YAML document; raise :class:`PolicyLoadError` naming file, line and key."""
    if len(text.encode("utf-8", errors="replace")) > MAX_DOCUMENT_BYTES:
        raise PolicyLoadError(
            [Problem(file, 1, "(document)", f"file is larger than {MAX_DOCUMENT_BYTES} bytes")]
        )
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise PolicyLoadError([Problem(file, 1, "(document)", "file is empty")])
        builder = _Builder(loader, file)
        data = builder.build(node, ())
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        parts = [part for part in (exc.context, exc.problem) if part]
        raise PolicyLoadError(
            [Problem(file, line, "(syntax)", "; ".join(parts) or "malformed YAML")]
        ) from None
    except yaml.YAMLError as exc:
        raise PolicyLoadError([Problem(file, 1, "(syntax)", str(exc))]) from None
    finally:
        loader.dispose()
    if builder.problems:
        raise PolicyLoadError(builder.problems)
    return LocatedDocument(data, LineMap(builder.lines))


class _Builder:
    """Turns a composed node tree into Python data, recording key lines and duplicates."""

    def __init__(self, loader: _Loader, file: str) -> None:
        self._loader = loader
        self._file = file
        self._active: set[int] = set()
        self._count = 0
        self.lines: dict[KeyPath, int] = {}
        self.problems: list[Problem] = []

    def build(self, node: Node, path: KeyPath) -> object:
        self.lines.setdefault(path, node.start_mark.line + 1)
        self._count += 1
        if self._count > MAX_NODES:
            raise yaml.MarkedYAMLError(
                problem=f"document has more than {MAX_NODES} nodes (alias expansion?)",
                problem_mark=node.start_mark,
            )
        if isinstance(node, ScalarNode):
            return self._loader.construct_object(node, deep=True)
        if id(node) in self._active:
            raise yaml.MarkedYAMLError(problem="recursive alias", problem_mark=node.start_mark)
        if node.tag not in _PLAIN_COLLECTION_TAGS:
            # The builder constructs collections itself; a tag would be silently ignored.
            raise yaml.MarkedYAMLError(
                problem=f"unsupported tag {node.tag!r}", problem_mark=node.start_mark
            )
        self._active.add(id(node))
        try:
            if isinstance(node, MappingNode):
                return self._mapping(node, path)
            if isinstance(node, SequenceNode):
                return [self.build(item, (*path, i)) for i, item in enumerate(node.value)]
        finally:
            self._active.discard(id(node))
        raise yaml.MarkedYAMLError(problem="unsupported node", problem_mark=node.start_mark)

    def _mapping(self, node: MappingNode, path: KeyPath) -> dict[object, object]:
        result: dict[object, object] = {}
        first_line: dict[object, int] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if key_node.tag == "tag:yaml.org,2002:merge":
                self._problem(line, path, "merge keys (<<) are not supported; write keys out")
                continue
            if not isinstance(key_node, ScalarNode):
                self._problem(line, path, "mapping keys must be plain scalars")
                continue
            key = self._loader.construct_object(key_node)
            child: KeyPath = (*path, key if isinstance(key, str | int) else str(key))
            if key in first_line:
                self._problem(
                    line, child, f"duplicate key (first defined at line {first_line[key]})"
                )
                continue
            first_line[key] = line
            self.lines[child] = line
            result[key] = self.build(value_node, child)
        return result

    def _problem(self, line: int, path: KeyPath, message: str) -> None:
        self.problems.append(Problem(self._file, line, format_key_path(path), message))
