"""YAML loading that remembers where every value came from.

PyYAML's ``safe_load`` forgets positions, so errors found later (by a pydantic model) could
not name the line. :func:`load_yaml` composes the node tree, constructs plain Python
values from it, and records the 1-based line of every mapping key and sequence item
under its path (``("authorities", 0, "grants", 1)``). Duplicate keys, which PyYAML
silently collapses, are errors here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import yaml

PathKey = tuple[str | int, ...]


class YamlSourceError(ValueError):
    """Not valid YAML, or YAML we refuse (duplicate keys, several documents)."""

    def __init__(self, line: int | None, message: str) -> None:
        self.line = line
        self.message = message
        super().__init__(f"line {line}: {message}" if line is not None else message)


@dataclass(frozen=True)
class YamlSource:
    """Constructed data plus the line of each path in it."""

    data: object
    lines: dict[PathKey, int]

    def line_of(self, path: Sequence[str | int]) -> int | None:
        """Line of ``path``, or of its nearest ancestor that has one."""
        key = tuple(path)
        while key:
            if key in self.lines:
                return self.lines[key]
            key = key[:-1]
        return self.lines.get((), None)


def load_yaml(text: str) -> YamlSource:
    """Parse one YAML document with the safe loader, keeping line numbers."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return YamlSource(data=None, lines={})
        lines: dict[PathKey, int] = {(): node.start_mark.line + 1}
        _index(loader, node, (), lines, set())
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = mark.line + 1 if mark is not None else None
        raise YamlSourceError(line, str(err.problem or err.context or "invalid YAML")) from None
    except yaml.YAMLError as err:
        raise YamlSourceError(None, str(err)) from None
    finally:
        loader.dispose()
    return YamlSource(data=data, lines=lines)


def _index(
    loader: yaml.SafeLoader,
    node: yaml.Node,
    path: PathKey,
    lines: dict[PathKey, int],
    visited: set[int],
) -> None:
    # Aliases make the node graph a DAG (or a cycle): index each node once, so a
    # "billion laughs" document costs linear time; aliased paths fall back to an ancestor.
    if id(node) in visited:
        return
    visited.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: set[object] = set()
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise YamlSourceError(key_node.start_mark.line + 1, "mapping keys must be scalars")
            key = loader.construct_object(key_node)
            if not isinstance(key, str | int) or isinstance(key, bool):
                key = str(key)
            if key in seen:
                raise YamlSourceError(key_node.start_mark.line + 1, f"duplicate key {key!r}")
            seen.add(key)
            child = (*path, key)
            lines[child] = key_node.start_mark.line + 1
            _index(loader, value_node, child, lines, visited)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            child = (*path, index)
            lines[child] = item.start_mark.line + 1
            _index(loader, item, child, lines, visited)
