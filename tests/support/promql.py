"""A small PromQL reader: the vector selectors of an expression, with their matchers.

Enough to check what dashboards and alert rules select; Grafana variables (``$job``,
``${x}``, ``$__rate_interval``) are allowed where PromQL takes a value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2", "start", "end"}
)
_LABEL_LISTS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_TOKEN = re.compile(
    r"""
    (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<lbrace>\{)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<number>[0-9][0-9A-Za-z_.]*)
  | (?P<variable>\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*)
  | (?P<space>\s+)
  | (?P<other>.)
    """,
    re.VERBOSE | re.DOTALL,
)
_STRING = re.compile(r""""(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'""")
_MATCHER = re.compile(
    r"""\s*(?P<label>[A-Za-z_][A-Za-z0-9_]*)\s*(?P<op>=~|!~|!=|=)\s*
        (?P<value>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*')\s*(?:,|$)""",
    re.VERBOSE,
)


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str
    value: str


@dataclass(frozen=True)
class Selector:
    """A vector selector: a metric name and its label matchers."""

    name: str
    matchers: tuple[Matcher, ...] = field(default=())


def _tokens(expr: str) -> list[tuple[str, str]]:
    return [
        (match.lastgroup or "", match.group())
        for match in _TOKEN.finditer(expr)
        if match.lastgroup != "space"
    ]


def _matchers(body: str) -> tuple[Matcher, ...]:
    found, position = [], 0
    while position < len(body.strip()):
        match = _MATCHER.match(body, position)
        if match is None:
            raise ValueError(f"cannot read label matchers {{{body}}} at {body[position:]!r}")
        found.append(Matcher(match["label"], match["op"], match["value"][1:-1]))
        position = match.end()
    return tuple(found)


def _braces(expr: str, start: int) -> int:
    """Index just past the ``}`` closing the ``{`` at ``start`` (strings skipped)."""
    i = start + 1
    while i < len(expr):
        string = _STRING.match(expr, i)
        if string is not None:
            i = string.end()
        elif expr[i] == "}":
            return i + 1
        else:
            i += 1
    raise ValueError(f"unclosed {{ in {expr!r}")


def selectors(expr: str) -> list[Selector]:
    """Every vector selector of a PromQL expression (Grafana variables allowed)."""
    # Label matcher blocks go first, so their contents are never read as names.
    blocks: list[str] = []
    flat, i = [], 0
    while i < len(expr):
        string = _STRING.match(expr, i)
        if string is not None:
            flat.append(string.group())
            i = string.end()
        elif expr[i] == "{":
            end = _braces(expr, i)
            blocks.append(expr[i + 1 : end - 1])
            flat.append(f"{{{len(blocks) - 1}}}")
            i = end
        else:
            flat.append(expr[i])
            i += 1
    tokens = _tokens("".join(flat))
    found: list[Selector] = []
    skip_list = False
    for n, (kind, text) in enumerate(tokens):
        following = tokens[n + 1] if n + 1 < len(tokens) else ("", "")
        if skip_list:
            if kind == "other" and text == ")":
                skip_list = False
            continue
        if kind == "ident":
            if text in _LABEL_LISTS:
                skip_list = following == ("other", "(")
                continue
            is_call = following == ("other", "(") or following[1] in ("by", "without")
            if text in _KEYWORDS or is_call:
                continue
            matchers: tuple[Matcher, ...] = ()
            if following[0] == "lbrace":
                matchers = _matchers(blocks[int(_block_index(tokens, n + 1))])
            found.append(Selector(text, matchers))
        elif kind == "lbrace" and (n == 0 or tokens[n - 1][0] != "ident"):
            block = _matchers(blocks[int(_block_index(tokens, n))])
            names = [m.value for m in block if m.label == "__name__" and m.op == "="]
            if not names:
                raise ValueError(f"selector without a metric name in {expr!r}")
            found.append(Selector(names[0], tuple(m for m in block if m.label != "__name__")))
    return found


def _block_index(tokens: list[tuple[str, str]], n: int) -> str:
    # "{3}" was tokenised as lbrace, number "3", other "}".
    return tokens[n + 1][1]
