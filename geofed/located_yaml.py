"""YAML documents that remember where every key came from.

:func:`parse_located` parses one YAML document into plain Python data plus a
:class:`LineMap` from key paths (``("exports", "raw_data", 0, "to")``) to 1-based line
numbers, so errors found later (by a pydantic model) can name the exact line. PyYAML's
``safe_load`` forgets positions and silently collapses duplicate keys; here duplicate
keys, merge keys, tags on collections and recursive aliases are problems, all of them
reported at once, and the size of a document is bounded. Booleans are YAML 1.2's: ``NO``
(Norway) and ``on`` stay strings.

Hostile text is refused while it is parsed, never after: the composer counts nodes
(``max_nodes``) and nesting (:data:`MAX_DEPTH`) as it creates them, so neither a huge
document nor 100,000 nested brackets costs more than the budget or exhausts the stack.
libyaml scans and parses when PyYAML has it (several times faster); the composer, with
its budget and lines, is the same either way.

Every node is constructed once: an alias shares the object of its anchor, so a
document of nested aliases costs time linear in its text; an aliased path has no line
of its own and takes its nearest ancestor's. Consumers that walk the data the aliases
expand to bound that expansion with ``max_nodes``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.composer import Composer, ComposerError
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.resolver import Resolver

__all__ = [
    "DOCUMENT_KEY",
    "MAX_DEPTH",
    "MAX_DOCUMENT_BYTES",
    "MAX_NODES",
    "SYNTAX_KEY",
    "KeyPath",
    "LineMap",
    "LocatedDocument",
    "LocatedYamlError",
    "YamlProblem",
    "format_key_path",
    "parse_located",
]

KeyPath = tuple[str | int, ...]

# Configuration and policy files are small and written by people; these bounds stop
# alias bombs early.
MAX_DOCUMENT_BYTES = 1 << 20
MAX_NODES = 100_000
#: Deeper nesting than any configuration needs; refused before it can exhaust the stack.
MAX_DEPTH = 64

#: The key a problem names when it concerns the whole document, or its YAML syntax.
DOCUMENT_KEY = "(document)"
SYNTAX_KEY = "(syntax)"

_BOOL_TAG = "tag:yaml.org,2002:bool"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_PLAIN_COLLECTION_TAGS = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")


class _Budget:
    """Bounds on composing one document, checked as each node is created."""

    max_depth: int = MAX_DEPTH
    max_nodes: int | None = MAX_NODES
    _depth = 0
    _nodes = 0

    # The composer's own recursion is the one that could overflow: refusing a node
    # deeper than ``max_depth`` bounds it, and every later step recurses no deeper.
    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        composer: Any = self  # a Composer: this class is mixed in before one
        if self._depth >= self.max_depth:
            raise ComposerError(
                None,
                None,
                f"nested deeper than {self.max_depth} levels",
                composer.peek_event().start_mark,
            )
        self._nodes += 1
        if self.max_nodes is not None and self._nodes > self.max_nodes:
            raise ComposerError(
                None,
                None,
                f"document has more than {self.max_nodes} nodes",
                composer.peek_event().start_mark,
            )
        self._depth += 1
        try:
            node: Node | None = Composer.compose_node(composer, parent, index)
        finally:
            self._depth -= 1
        return node


class _Loader(_Budget, yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans (``NO``, Norway, and ``on`` stay strings), bounded."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _libyaml_parser() -> Any:
    try:
        from yaml._yaml import CParser
    except ImportError:  # PyYAML built without libyaml: the pure-Python parser does it all
        return None
    return CParser


_CParser: Any = _libyaml_parser()
_FastLoader: Any = None
if _CParser is not None:

    class _CLoader(_Budget, Composer, _CParser, SafeConstructor, Resolver):  # type: ignore[misc]
        """libyaml's scanner and parser (events with their lines) under the same composer."""

        def __init__(self, stream: str) -> None:
            _CParser.__init__(self, stream)
            Composer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)

        def dispose(self) -> None:
            """Nothing to release beyond what the parser frees itself."""

    _CLoader.yaml_implicit_resolvers = _Loader.yaml_implicit_resolvers
    _FastLoader = _CLoader


def format_key_path(path: KeyPath) -> str:
    """``("exports", "raw_data", 0, "to")`` -> ``exports.raw_data[0].to``."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or DOCUMENT_KEY


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
    """A parsed document (``None`` when it is empty) and the line of each key path in it."""

    data: object
    lines: LineMap


@dataclass(frozen=True, slots=True)
class YamlProblem:
    """One thing wrong with a document: its line, the key path it concerns, what."""

    line: int
    key: str
    message: str


class LocatedYamlError(ValueError):
    """The text is not a document :func:`parse_located` accepts; ``problems`` says where."""

    def __init__(self, problems: list[YamlProblem]) -> None:
        if not problems:
            raise ValueError("LocatedYamlError needs at least one problem")
        self.problems = tuple(problems)
        first = self.problems[0]
        super().__init__(f"line {first.line}: {first.key}: {first.message}")


def parse_located(
    text: str,
    *,
    max_bytes: int | None = MAX_DOCUMENT_BYTES,
    max_nodes: int | None = MAX_NODES,
) -> LocatedDocument:
    """Parse one YAML document, keeping the line of every key path.

    ``max_bytes`` bounds the text's UTF-8 size and ``max_nodes`` the nodes of the data
    once its aliases are expanded (None: no bound). Raise :class:`LocatedYamlError`
    listing every problem found.
    """
    if max_bytes is not None and len(text.encode("utf-8", errors="replace")) > max_bytes:
        raise LocatedYamlError(
            [YamlProblem(1, DOCUMENT_KEY, f"file is larger than {max_bytes} bytes")]
        )
    # libyaml accepts tabs where PyYAML's own parser refuses them; a text with tabs takes
    # the pure-Python path so every document parses the same with or without libyaml.
    loader = (_FastLoader if _FastLoader is not None and "\t" not in text else _Loader)(text)
    loader.max_nodes = max_nodes
    try:
        node = loader.get_single_node()
        if node is None:
            return LocatedDocument(None, LineMap({}))
        builder = _Builder(loader, max_nodes)
        data = builder.build(node, ())
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        parts = [part for part in (exc.context, exc.problem) if part]
        raise LocatedYamlError(
            [YamlProblem(line, SYNTAX_KEY, "; ".join(parts) or "malformed YAML")]
        ) from None
    except yaml.YAMLError as exc:
        raise LocatedYamlError([YamlProblem(1, SYNTAX_KEY, str(exc))]) from None
    finally:
        loader.dispose()
    if builder.problems:
        raise LocatedYamlError(builder.problems)
    return LocatedDocument(data, LineMap(builder.lines))


class _Builder:
    """Turns a composed node tree into Python data, recording key lines and duplicates."""

    def __init__(self, loader: _Loader, max_nodes: int | None) -> None:
        self._loader = loader
        self._max_nodes = max_nodes
        self._active: set[int] = set()
        # Each node's data and its size once aliases are expanded, by node identity.
        self._built: dict[int, tuple[object, int]] = {}
        self.lines: dict[KeyPath, int] = {}
        self.problems: list[YamlProblem] = []

    def build(self, node: Node, path: KeyPath) -> object:
        return self._build(node, path)[0]

    def _build(self, node: Node, path: KeyPath) -> tuple[object, int]:
        self.lines.setdefault(path, node.start_mark.line + 1)
        done = self._built.get(id(node))
        if done is not None:
            return done
        if isinstance(node, ScalarNode):
            result: tuple[object, int] = (self._loader.construct_object(node, deep=True), 1)
        else:
            result = self._collection(node, path)
        if self._max_nodes is not None and result[1] > self._max_nodes:
            raise yaml.MarkedYAMLError(
                problem=f"document has more than {self._max_nodes} nodes (alias expansion?)",
                problem_mark=node.start_mark,
            )
        self._built[id(node)] = result
        return result

    def _collection(self, node: Node, path: KeyPath) -> tuple[object, int]:
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
                items, size = [], 1
                for index, item in enumerate(node.value):
                    value, count = self._build(item, (*path, index))
                    items.append(value)
                    size += count
                return items, size
        finally:
            self._active.discard(id(node))
        raise yaml.MarkedYAMLError(problem="unsupported node", problem_mark=node.start_mark)

    def _mapping(self, node: MappingNode, path: KeyPath) -> tuple[object, int]:
        result: dict[object, object] = {}
        size = 1
        first_line: dict[object, int] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if key_node.tag == _MERGE_TAG:
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
            value, count = self._build(value_node, child)
            result[key] = value
            size += count
        return result, size

    def _problem(self, line: int, path: KeyPath, message: str) -> None:
        self.problems.append(YamlProblem(line, format_key_path(path), message))
