"""Located YAML: data plus the line of every key path, and every problem at once."""

from __future__ import annotations

import pytest

from geofed.located_yaml import (
    DOCUMENT_KEY,
    SYNTAX_KEY,
    LineMap,
    LocatedYamlError,
    format_key_path,
    parse_located,
)

TEXT = """\
region: eu-west
exports:
  raw_data:
    - effect: deny
      to: [coordinator, "region:us-*"]
answer: NO
on: yes
enabled: true
"""


def test_data_and_the_line_of_every_key_and_item() -> None:
    document = parse_located(TEXT)
    assert document.data == {
        "region": "eu-west",
        "exports": {"raw_data": [{"effect": "deny", "to": ["coordinator", "region:us-*"]}]},
        "answer": "NO",
        "on": "yes",
        "enabled": True,
    }
    lines = document.lines
    assert lines.line_of(()) == 1
    assert lines.line_of(("exports",)) == 2
    assert lines.line_of(("exports", "raw_data", 0)) == 4
    assert lines.line_of(("exports", "raw_data", 0, "to", 1)) == 5
    # A key that is not there takes its nearest ancestor's line.
    assert lines.line_of(("exports", "raw_data", 0, "missing")) == 4
    assert LineMap({}).line_of(("anything",)) == 1


def test_key_paths_read_like_the_file() -> None:
    assert format_key_path(("exports", "raw_data", 0, "to")) == "exports.raw_data[0].to"
    assert format_key_path((0, "a")) == "[0].a"
    assert format_key_path(()) == DOCUMENT_KEY


def test_an_empty_document_has_no_data_and_no_lines() -> None:
    document = parse_located("# only a comment\n")
    assert document.data is None
    assert not document.lines.lines


def test_every_duplicate_and_merge_key_is_reported() -> None:
    text = "a: 1\nb: {x: 1, x: 2}\na: 3\nc:\n  <<: {y: 1}\n"
    with pytest.raises(LocatedYamlError) as caught:
        parse_located(text)
    found = [(p.line, p.key, p.message) for p in caught.value.problems]
    assert found == [
        (2, "b.x", "duplicate key (first defined at line 2)"),
        (3, "a", "duplicate key (first defined at line 1)"),
        (5, "c", "merge keys (<<) are not supported; write keys out"),
    ]
    assert str(caught.value).startswith("line 2: b.x: duplicate key")


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("a: [1, 2\n", 2, "expected ',' or ']'"),
        ("a: !!python/object/apply:os.system [ls]\n", 1, "unsupported tag"),
        ("a: !!python/name:os.system\n", 1, "constructor"),
        ("a: &x [*x]\n", 1, "recursive alias"),
        ("--- 1\n--- 2\n", 2, "expected a single document"),
    ],
)
def test_syntax_problems_name_their_line(text: str, line: int, words: str) -> None:
    with pytest.raises(LocatedYamlError) as caught:
        parse_located(text)
    [problem] = caught.value.problems
    assert (problem.line, problem.key) == (line, SYNTAX_KEY)
    assert words in problem.message


def _bomb(levels: int, fanout: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * fanout)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_aliases_share_their_anchors_data_in_linear_time() -> None:
    # 4**40 nodes once expanded; never let an assertion print the data.
    document = parse_located(_bomb(40, 4), max_nodes=None)
    data = document.data
    assert isinstance(data, dict)
    top = data["a39"]
    assert isinstance(top, list)
    assert top[0] is top[1] is data["a38"]
    # An aliased item is recorded at its anchor's line; deeper paths take that line too.
    line = document.lines.line_of(("a39", 0, 0, 0))
    assert line == 39


def test_max_nodes_bounds_what_the_aliases_expand_to() -> None:
    with pytest.raises(LocatedYamlError) as caught:
        parse_located(_bomb(7, 10), max_nodes=100_000)
    [problem] = caught.value.problems
    assert "more than 100000 nodes" in problem.message
    assert problem.key == SYNTAX_KEY
    assert parse_located(_bomb(3, 10), max_nodes=2_000).data is not None


def test_max_bytes_bounds_the_text() -> None:
    text = "a: " + "x" * 100 + "\n"
    with pytest.raises(LocatedYamlError) as caught:
        parse_located(text, max_bytes=50)
    [problem] = caught.value.problems
    assert (problem.line, problem.key) == (1, DOCUMENT_KEY)
    assert "larger than 50 bytes" in problem.message
    assert parse_located(text, max_bytes=None).data == {"a": "x" * 100}
