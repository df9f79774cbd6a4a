"""Reading region policy files from disk into a checked :class:`PolicySet`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from policies.destinations import PatternKind
from policies.errors import PolicyLoadError, Problem, Severity
from policies.policy_set import LoadedPolicy, PolicySet, rule_lists
from policies.schema import RegionPolicy
from policies.validation import validate_document
from policies.yaml_loader import load_located

POLICY_SUFFIXES = (".yaml", ".yml")

_PROCESSING_PATTERNS = (PatternKind.ANY, PatternKind.REGION, PatternKind.JURISDICTION)


def parse_policy(text: str, file: str) -> LoadedPolicy:
    """Parse and validate one policy document; ``file`` is the name used in errors.

    Raise :class:`PolicyLoadError` with every problem found in the document.
    """
    document = load_located(text, file)
    policy = validate_document(RegionPolicy, document, file)
    loaded = LoadedPolicy(policy, file, document.lines)
    problems = check_policy(loaded)
    errors = [p for p in problems if p.severity is Severity.ERROR]
    if errors:
        raise PolicyLoadError(errors)
    return replace(loaded, warnings=tuple(problems))


def check_policy(loaded: LoadedPolicy) -> list[Problem]:
    """Problems inside one file that the schema alone cannot see."""
    policy = loaded.policy
    problems: list[Problem] = []
    for section, names in (
        ("datasets", [d.name for d in policy.datasets]),
        ("storage", [s.name for s in policy.storage]),
    ):
        first: dict[str, int] = {}
        for index, name in enumerate(names):
            if name in first:
                where = loaded.origin((section, first[name], "name"))
                problems.append(
                    loaded.problem((section, index, "name"), f"{name} is already listed at {where}")
                )
            first.setdefault(name, index)
    for index, dataset in enumerate(policy.datasets):
        for j, pattern in enumerate(dataset.processed_in):
            if pattern.kind not in _PROCESSING_PATTERNS:
                problems.append(
                    loaded.problem(
                        ("datasets", index, "processed_in", j),
                        f"datasets are processed in regions: use region:NAME, "
                        f"jurisdiction:CODE or *, not {pattern}",
                    )
                )
    for path, rules in rule_lists(policy):
        for kind, entries in rules.items():
            for i, rule in enumerate(entries[:-1]):
                if any(p.kind is PatternKind.ANY for p in rule.to):
                    problems.append(
                        loaded.problem(
                            (*path, kind.value, i + 1),
                            f"unreachable: rule [{i}] above already matches every destination",
                            Severity.WARNING,
                        )
                    )
                    break
    return problems


def load_policy_file(path: Path | str) -> LoadedPolicy:
    """Read and validate one policy file; errors name the path as given."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyLoadError([Problem(file, None, "(file)", f"not UTF-8 text: {exc}")]) from None
    except OSError as exc:
        raise PolicyLoadError([Problem(file, None, "(file)", exc.strerror or str(exc))]) from None
    return parse_policy(text, file)


def policy_files(paths: Iterable[Path | str]) -> list[Path]:
    """Expand directories to their ``*.yaml``/``*.yml`` files (sorted, not recursive)."""
    files: list[Path] = []
    problems: list[Problem] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix in POLICY_SUFFIXES and p.is_file())
            if not found:
                problems.append(Problem(str(path), None, "(file)", "directory has no *.yaml files"))
            files.extend(found)
        else:
            files.append(path)
    if problems:
        raise PolicyLoadError(problems)
    return files


def load_policies(paths: Iterable[Path | str]) -> PolicySet:
    """Load every policy file under ``paths`` into one checked :class:`PolicySet`.

    All files are read before failing, so one :class:`PolicyLoadError` reports every
    problem of every file; cross-file errors are reported only once each file is valid.
    """
    loaded: list[LoadedPolicy] = []
    problems: list[Problem] = []
    for file in policy_files(paths):
        try:
            loaded.append(load_policy_file(file))
        except PolicyLoadError as exc:
            problems.extend(exc.problems)
    if problems:
        raise PolicyLoadError(problems)
    return PolicySet(loaded)
