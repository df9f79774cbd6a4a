"""Policy and configuration files as located YAML documents, their problems as policy problems.

The parsing is :mod:`geofed.located_yaml`'s; this module names the file in each problem
(``eu-west.yaml:12: exports.raw_data[0].to[1]: ...``) and refuses an empty file.
"""

from __future__ import annotations

from geofed.located_yaml import (
    DOCUMENT_KEY,
    MAX_NODES,
    LocatedDocument,
    LocatedYamlError,
    parse_located,
)
from policies.errors import PolicyLoadError, Problem

__all__ = ["load_located"]


def load_located(text: str, file: str, *, max_nodes: int = MAX_NODES) -> LocatedDocument:
    """Parse one YAML document; raise :class:`PolicyLoadError` naming file, line and key."""
    try:
        document = parse_located(text, max_nodes=max_nodes)
    except LocatedYamlError as exc:
        raise PolicyLoadError(
            [Problem(file, problem.line, problem.key, problem.message) for problem in exc.problems]
        ) from None
    if document.data is None and not document.lines.lines:
        raise PolicyLoadError([Problem(file, 1, DOCUMENT_KEY, "file is empty")])
    return document
