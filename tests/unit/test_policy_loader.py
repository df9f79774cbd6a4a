"""Loading region policy files: every error names the file, the line and the key path."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from geofed.located_yaml import MAX_NODES
from policies import (
    Classification,
    PolicyLoadError,
    PolicySet,
    Problem,
    Severity,
    load_placement,
    load_policies,
    load_policy_file,
    parse_policy,
    placement,
    schema,
)

VALID = """\
region: eu-west
jurisdiction: EU
datasets:
  - name: eu-chats
    classification: personal
    processed_in: [region:eu-west]
storage:
  - name: eu-ckpt
    jurisdiction: EU
exports:
  model_delta:
    - effect: allow
      to: [coordinator]
"""


def _problems(text: str, file: str = "p.yaml") -> tuple[Problem, ...]:
    with pytest.raises(PolicyLoadError) as caught:
        parse_policy(text, file)
    return caught.value.problems


def _only(text: str) -> Problem:
    problems = _problems(text)
    assert len(problems) == 1, problems
    return problems[0]


def test_valid_policy_loads_with_lines() -> None:
    loaded = parse_policy(VALID, "eu.yaml")
    assert loaded.region == "eu-west"
    assert loaded.policy.datasets[0].classification is Classification.PERSONAL
    assert loaded.origin(("exports", "model_delta", 0)) == "eu.yaml:12"
    assert loaded.origin(("datasets", 0, "processed_in")) == "eu.yaml:6"
    assert loaded.warnings == ()


# (broken text, line, key path, words in the message)
LOAD_ERRORS = [
    pytest.param(
        VALID.replace("    classification: personal", "    classification: personal\n    owner: x"),
        6,
        "datasets[0].owner",
        ["unknown key", "allowed keys: name, classification, processed_in"],
        id="unknown-key",
    ),
    pytest.param(
        VALID.replace("      to: [coordinator]", "      to: [coordinator]\n      until: 2030"),
        14,
        "exports.model_delta[0].until",
        ["unknown key", "effect, to, note"],
        id="unknown-key-in-rule",
    ),
    pytest.param(
        VALID.replace("processed_in: [region:eu-west]", "processed_in: 7"),
        6,
        "datasets[0].processed_in",
        ["should be a list", "got 7"],
        id="wrong-type",
    ),
    pytest.param(
        VALID.replace("jurisdiction: EU\ndatasets", "jurisdiction: [EU]\ndatasets"),
        2,
        "jurisdiction",
        ["valid string"],
        id="wrong-type-list-for-string",
    ),
    pytest.param(
        VALID.replace("classification: personal", "classification: secret"),
        5,
        "datasets[0].classification",
        ["'public', 'internal', 'confidential' or 'personal'", "got 'secret'"],
        id="bad-enum-classification",
    ),
    pytest.param(
        VALID.replace("effect: allow", "effect: permit"),
        12,
        "exports.model_delta[0].effect",
        ["'allow' or 'deny'", "got 'permit'"],
        id="bad-enum-effect",
    ),
    pytest.param(
        VALID.replace("  model_delta:", "  weights:"),
        11,
        "exports.weights",
        ["invalid key 'weights'", "'model_delta'"],
        id="bad-enum-artifact-kind",
    ),
    pytest.param(
        VALID.replace("exports:\n", "exports:\n  metrics: []\n  metrics: []\n"),
        12,
        "exports.metrics",
        ["duplicate key (first defined at line 11)"],
        id="duplicate-key",
    ),
    pytest.param(
        VALID + "region: us-east\n",
        14,
        "region",
        ["duplicate key (first defined at line 1)"],
        id="duplicate-top-level-key",
    ),
    pytest.param(
        VALID.replace("to: [coordinator]", "to: [coordinator"),
        14,
        "(syntax)",
        ["flow sequence"],
        id="malformed-yaml",
    ),
    pytest.param(
        VALID.replace("    jurisdiction: EU\n", "   jurisdiction: EU\n"),
        9,
        "(syntax)",
        [],
        id="bad-indentation",
    ),
    pytest.param(
        VALID.replace("    processed_in: [region:eu-west]\n", ""),
        4,
        "datasets[0].processed_in",
        ["missing required key 'processed_in'"],
        id="missing-required-field",
    ),
    pytest.param(
        VALID.replace("jurisdiction: EU\ndatasets", "datasets"),
        1,
        "jurisdiction",
        ["missing required key 'jurisdiction'"],
        id="missing-top-level-field",
    ),
    pytest.param(
        VALID.replace("to: [coordinator]", "to: [coordinator, 'regoin:us-east']"),
        13,
        "exports.model_delta[0].to[1]",
        ["invalid destination 'regoin:us-east'", "region:NAME"],
        id="bad-destination",
    ),
    pytest.param(
        VALID.replace("to: [coordinator]", "to: []"),
        13,
        "exports.model_delta[0].to",
        ["at least 1 item"],
        id="empty-destination-list",
    ),
    pytest.param(
        VALID.replace("region: eu-west", "region: EU_West"),
        1,
        "region",
        ["invalid region 'EU_West'"],
        id="bad-region-name",
    ),
    pytest.param(
        VALID.replace("jurisdiction: EU\ndatasets", "jurisdiction: europe\ndatasets"),
        2,
        "jurisdiction",
        ["invalid jurisdiction 'europe'"],
        id="bad-jurisdiction",
    ),
    pytest.param(
        VALID.replace("processed_in: [region:eu-west]", "processed_in: [storage:eu-ckpt]"),
        6,
        "datasets[0].processed_in[0]",
        ["processed in regions", "not storage:eu-ckpt"],
        id="processing-in-storage",
    ),
    pytest.param(
        VALID.replace("storage:\n", "storage:\n  - {name: eu-ckpt, jurisdiction: EU}\n"),
        9,
        "storage[1].name",
        ["eu-ckpt is already listed at p.yaml:8"],
        id="duplicate-storage-in-file",
    ),
    pytest.param(
        VALID.replace("  model_delta:", "  <<: {}\n  model_delta:"),
        11,
        "exports",
        ["merge keys"],
        id="merge-key",
    ),
    pytest.param(
        "region: !!python/object/apply:os.system [ls]\n",
        1,
        "(syntax)",
        ["unsupported tag"],
        id="unsafe-tag",
    ),
    pytest.param(
        "region: !!python/name:os.system\n", 1, "(syntax)", ["constructor"], id="unsafe-scalar-tag"
    ),
    pytest.param("- region: eu-west\n", 1, "(document)", ["mapping"], id="not-a-mapping"),
    pytest.param("# nothing here\n", 1, "(document)", ["empty"], id="empty-file"),
]


@pytest.mark.parametrize(("text", "line", "key", "words"), LOAD_ERRORS)
def test_load_error_names_file_line_and_key(
    text: str, line: int, key: str, words: list[str]
) -> None:
    problem = _only(text)
    assert str(problem).startswith(f"p.yaml:{line}: {key}: "), str(problem)
    assert (problem.file, problem.line, problem.key) == ("p.yaml", line, key)
    for word in words:
        assert word in problem.message


def test_every_error_of_a_file_is_reported() -> None:
    text = VALID.replace("classification: personal", "classification: secret").replace(
        "effect: allow", "effect: permit"
    )
    keys = [p.key for p in _problems(text + "colour: blue\n")]
    assert keys == ["datasets[0].classification", "exports.model_delta[0].effect", "colour"]


def test_norway_stays_a_jurisdiction_code() -> None:
    # YAML 1.1 would read NO as false; policies use YAML 1.2 booleans.
    loaded = parse_policy("region: oslo\njurisdiction: NO\n", "no.yaml")
    assert loaded.policy.jurisdiction == "NO"


def test_alias_bomb_is_refused() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 7)]
    problem = _only("\n".join(lines) + "\n")
    assert f"more than {MAX_NODES} nodes" in problem.message


def test_unreachable_rule_is_a_warning() -> None:
    text = VALID.replace(
        "      to: [coordinator]\n",
        "      to: ['*']\n    - effect: deny\n      to: [coordinator]\n",
    )
    loaded = parse_policy(text, "w.yaml")
    assert [str(w) for w in loaded.warnings] == [
        "w.yaml:14: exports.model_delta[1]: warning: unreachable: rule [0] above already "
        "matches every destination"
    ]


def test_missing_file_and_non_utf8(tmp_path: Path) -> None:
    with pytest.raises(PolicyLoadError) as caught:
        load_policy_file(tmp_path / "absent.yaml")
    assert str(caught.value.problems[0]).startswith(f"{tmp_path / 'absent.yaml'}: (file): ")
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"region: \xff\xfe\n")
    with pytest.raises(PolicyLoadError, match="not UTF-8"):
        load_policy_file(binary)


def _write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


def test_directory_loads_yaml_and_yml_only(tmp_path: Path) -> None:
    _write(tmp_path, "a.yaml", VALID)
    _write(tmp_path, "b.yml", "region: us-east\njurisdiction: US\n")
    _write(tmp_path, "notes.txt", "not a policy")
    policies = load_policies([tmp_path])
    assert list(policies) == ["eu-west", "us-east"]
    assert policies.jurisdiction_of("us-east") == "US"
    assert policies.storage("eu-ckpt") is not None
    assert policies.dataset("eu-chats") is not None


def test_empty_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyLoadError, match=r"directory has no \*\.yaml files"):
        load_policies([tmp_path])


def test_errors_of_every_file_are_collected(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.yaml", "region: a\n")
    b = _write(tmp_path, "b.yaml", "region: b\njurisdiction: US\nextra: 1\n")
    with pytest.raises(PolicyLoadError) as caught:
        load_policies([tmp_path])
    assert [str(p) for p in caught.value.problems] == [
        f"{a}:1: jurisdiction: missing required key 'jurisdiction'",
        f"{b}:3: extra: unknown key; allowed keys: region, jurisdiction, description, "
        "datasets, storage, exports",
    ]


def test_cross_file_conflicts(tmp_path: Path) -> None:
    first = _write(tmp_path, "a.yaml", VALID)
    second = _write(
        tmp_path,
        "b.yaml",
        VALID.replace("exports:", "description: copy\nexports:"),
    )
    third = _write(
        tmp_path,
        "c.yaml",
        "region: us-east\njurisdiction: US\ndatasets:\n  - name: eu-chats\n"
        "    classification: public\n    processed_in: ['*']\n"
        "storage:\n  - name: eu-ckpt\n    jurisdiction: US\n",
    )
    with pytest.raises(PolicyLoadError) as caught:
        load_policies([first, second, third])
    assert [str(p) for p in caught.value.problems] == [
        f"{second}:1: region: region eu-west is already defined at {first}:1",
        f"{third}:4: datasets[0].name: dataset eu-chats is already defined at {first}:4",
        f"{third}:8: storage[0].name: storage location eu-ckpt is already defined at {first}:8",
    ]


def test_dangling_references_are_warnings(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "a.yaml",
        VALID.replace("to: [coordinator]", "to: [coordinator, 'region:us-east', 'storage:s3']"),
    )
    policies = load_policies([path])
    assert [(w.key, w.severity) for w in policies.warnings] == [
        ("exports.model_delta[0].to[1]", Severity.WARNING),
        ("exports.model_delta[0].to[2]", Severity.WARNING),
    ]
    assert "matches nothing" in policies.warnings[0].message


def _yaml_example(docstring: str | None) -> str:
    assert docstring is not None
    after = docstring.split(".. code-block:: yaml\n\n", 1)[1]
    block: list[str] = []
    for line in after.splitlines():
        if line and not line.startswith("    "):
            break
        block.append(line)
    return textwrap.dedent("\n".join(block))


def test_documented_examples_are_valid(tmp_path: Path) -> None:
    loaded = parse_policy(_yaml_example(schema.__doc__), "schema-example.yaml")
    assert loaded.region == "eu-west"
    assert loaded.warnings == ()
    policies = PolicySet([loaded])
    job = tmp_path / "job.yaml"
    job.write_text(_yaml_example(placement.__doc__), encoding="utf-8")
    parsed = load_placement(job, policies)
    assert dict(parsed.regions) == {
        "eu-west": frozenset({"eu-support-chats"}),
        "us-east": frozenset({"us-public-domain-books"}),
    }
    assert [(s.name, s.jurisdiction, s.region) for s in parsed.checkpoint_storage] == [
        ("eu-ckpt", "EU", "eu-west"),
        ("scratch", "EU", "eu-west"),
    ]
