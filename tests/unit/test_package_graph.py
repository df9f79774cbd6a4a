"""The package graph runs one way: the face imports the daemons, the daemons the core.

``geofed/`` (the shared core) imports only itself and third-party libraries;
``policies/`` only itself and geofed's shared types and YAML loader; each daemon itself,
the core and ``policies/``, never the other daemon; ``geofed_cli/`` (the command and the
demo) anything. Every import counts, including those inside functions and under
``if TYPE_CHECKING``: a lazy import is still a dependency. Within a package, no two modules
import each other at module level, nor in a cycle of any length through lazy imports.
Inside ``regional_agent/`` the rank process (``worker/``) and the agent share only the
hand-off contract (``handoff/``), which imports nothing else of the agent.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Importing package -> the project modules (and their submodules) it may import. A module
# outside PROJECT is the standard library or a third-party one and always allowed.
ALLOWED: dict[str, tuple[str, ...]] = {
    "geofed": ("geofed",),
    "policies": ("policies", "geofed.types", "geofed.located_yaml"),
    "coordinator": ("coordinator", "geofed", "policies"),
    "regional_agent": ("regional_agent", "geofed", "policies"),
    "geofed_cli": ("geofed_cli", "geofed", "coordinator", "regional_agent", "policies"),
}
PROJECT: tuple[str, ...] = (*ALLOWED, "tests", "benchmarks")
# Entry points that live in a package's folder but belong to the face: `python -m geofed`
# runs the command line and is never imported by the library.
ENTRY_POINTS: dict[str, str] = {"geofed.__main__": "geofed_cli"}


@dataclass(frozen=True)
class Import:
    """One project-relevant import: where it is and the module it names."""

    line: int
    target: str
    module_level: bool


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    """Every module of the checked packages, by dotted name."""
    found: dict[str, Path] = {}
    for package in ALLOWED:
        for path in sorted((REPO / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


SOURCES = _sources()


def imports_of(source: str, module: str, *, is_package: bool, known: set[str]) -> list[Import]:
    """The imports in ``source``, resolved to the deepest module in ``known`` they name.

    ``from pkg import name`` names ``pkg.name`` when that is a module, else ``pkg``; a
    relative import is resolved against ``module``; ``importlib.import_module("x")`` with
    a literal name counts as importing ``x``.
    """
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    found: dict[Import, None] = {}  # ordered, and one entry for `from x import a, b`

    def visit(node: ast.AST, module_level: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found[Import(node.lineno, alias.name, module_level)] = None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                target = submodule if submodule in known else base
                found[Import(node.lineno, target, module_level)] = None
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found[Import(node.lineno, node.args[0].value, module_level)] = None
        # A function's body runs when called, not when its module is imported.
        inner = module_level and not isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
        )
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, module_level=True)
    return list(found)


def _imports(module: str) -> Iterator[tuple[Path, Import]]:
    path = SOURCES[module]
    source = path.read_text(encoding="utf-8")
    for imp in imports_of(
        source, module, is_package=path.name == "__init__.py", known=set(SOURCES)
    ):
        yield path, imp


def owner(module: str) -> str:
    """The package whose rules apply to ``module``."""
    return ENTRY_POINTS.get(module, module.split(".")[0])


def forbidden_imports(package: str) -> list[str]:
    """``file:line: imports X`` for each import from ``package`` the graph does not allow."""
    allowed = ALLOWED[package]
    problems = []
    for module in SOURCES:
        if owner(module) != package:
            continue
        for path, imp in _imports(module):
            project = any(_within(imp.target, root) for root in PROJECT)
            if project and not any(_within(imp.target, prefix) for prefix in allowed):
                problems.append(
                    f"{path.relative_to(REPO)}:{imp.line}: imports {imp.target} "
                    f"({package} may import only {', '.join(allowed)} and third-party modules)"
                )
    return problems


def module_level_cycles() -> list[str]:
    """Pairs of modules of one package that import each other at module level."""
    edges: dict[str, dict[str, int]] = {}
    for module in SOURCES:
        top = module.split(".")[0]
        for _, imp in _imports(module):
            if imp.module_level and imp.target != module and _within(imp.target, top):
                edges.setdefault(module, {}).setdefault(imp.target, imp.line)
    cycles = []
    for a, targets in sorted(edges.items()):
        for b, line in sorted(targets.items()):
            if a < b and a in edges.get(b, {}):
                back = edges[b][a]
                cycles.append(
                    f"{SOURCES[a].relative_to(REPO)}:{line}: imports {b}, and "
                    f"{SOURCES[b].relative_to(REPO)}:{back}: imports {a}"
                )
    return cycles


def import_cycles() -> list[list[str]]:
    """Every set of modules of one package that reach each other through their imports,
    lazy ones included (a function-level import hides a cycle from the interpreter, not
    from the design): the strongly connected components of more than one module."""
    graph: dict[str, set[str]] = {module: set() for module in SOURCES}
    for module in SOURCES:
        top = module.split(".")[0]
        for _, imp in _imports(module):
            if imp.target != module and _within(imp.target, top) and imp.target in graph:
                graph[module].add(imp.target)
    return [sorted(c) for c in _components(graph) if len(c) > 1]


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (deep graphs stay in bounds)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                found.append(component)
    return found


def test_no_import_cycle_of_any_length() -> None:
    cycles = import_cycles()
    assert not cycles, "modules that import each other, lazily or not:\n" + "\n".join(
        " <-> ".join(cycle) for cycle in cycles
    )


def test_a_cycle_through_a_lazy_import_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [sorted(c) for c in _components(graph) if len(c) > 1] == [["a", "b", "c"]]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_the_graph_allows(package: str) -> None:
    assert any(_within(module, package) for module in SOURCES), f"no modules found in {package}/"
    problems = forbidden_imports(package)
    assert not problems, "forbidden imports:\n" + "\n".join(problems)


# Within regional_agent: the two processes of a region share only the hand-off contract.
# Subpackage -> the subpackages of regional_agent it may import.
AGENT_SIDES: dict[str, tuple[str, ...]] = {
    "regional_agent.handoff": ("regional_agent.handoff",),
    "regional_agent.worker": ("regional_agent.worker", "regional_agent.handoff"),
}


def crossing_imports() -> list[str]:
    """``file:line: imports X`` for each import across the agent/worker line: the contract
    (``handoff``) imports only itself, the rank process only itself and the contract, and
    nothing on the agent's side imports the rank process."""
    problems = []
    for module in SOURCES:
        if not _within(module, "regional_agent"):
            continue
        side = next((s for s in AGENT_SIDES if _within(module, s)), None)
        for path, imp in _imports(module):
            if not _within(imp.target, "regional_agent"):
                continue
            if side is None:
                crossing = _within(imp.target, "regional_agent.worker")
            else:
                crossing = not any(_within(imp.target, p) for p in AGENT_SIDES[side])
            if crossing:
                problems.append(f"{path.relative_to(REPO)}:{imp.line}: imports {imp.target}")
    return problems


def test_the_agent_and_its_ranks_share_only_the_handoff_contract() -> None:
    problems = crossing_imports()
    assert not problems, "imports across the agent/worker line:\n" + "\n".join(problems)


def test_no_two_modules_of_a_package_import_each_other() -> None:
    cycles = module_level_cycles()
    assert not cycles, "module-level import cycles:\n" + "\n".join(cycles)


def test_every_kind_of_import_is_seen() -> None:
    source = """\
import coordinator.metrics
from typing import TYPE_CHECKING
from . import sibling
from .. import types

if TYPE_CHECKING:
    from regional_agent.config import AgentConfig

def later():
    import importlib
    from regional_agent import daemon
    importlib.import_module("coordinator.daemon")
"""
    known = {"geofed.pki.sibling", "geofed.types", "regional_agent.daemon"}
    found = imports_of(source, "geofed.pki", is_package=True, known=known)
    assert [(imp.target, imp.module_level) for imp in found] == [
        ("coordinator.metrics", True),
        ("typing", True),
        ("geofed.pki.sibling", True),
        ("geofed.types", True),
        ("regional_agent.config", True),
        ("importlib", False),
        ("regional_agent.daemon", False),
        ("coordinator.daemon", False),
    ]


def test_no_test_module_imports_another_and_the_readme_names_every_support_module() -> None:
    """What two test modules share lives in tests/support, and tests/README.md says what."""
    tests = REPO / "tests"
    importing = []
    for path in sorted(tests.rglob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if any(_within(name, f"tests.{tier}") for tier in ("unit", "integration", "gpu")):
                    importing.append(f"{path.relative_to(REPO)}:{node.lineno}: imports {name}")
    assert not importing, "test modules importing test modules:\n" + "\n".join(importing)
    readme = (tests / "README.md").read_text(encoding="utf-8")
    unnamed = [
        path.name
        for path in sorted((tests / "support").glob("*.py"))
        if path.name != "__init__.py" and f"`{path.name}`" not in readme
    ]
    assert not unnamed, f"tests/README.md does not name {unnamed}"


#: ``path.py:symbol``, and pytest's ``path.py::test_name`` for the test that shows a claim.
_REFERENCE = re.compile(r"`((?:[\w.-]+/)*[\w.-]+\.py)::?([A-Za-z_][\w.]*)`")
_DIRECTORY = re.compile(r"`((?:[\w.-]+/)+)`")


def _defined(path: Path) -> set[str]:
    """Every function, class and assigned name of ``path``, at any depth."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def test_every_file_symbol_reference_of_the_docs_exists() -> None:
    """``path.py:symbol`` (or a test's ``path.py::test_name``) in docs/ and the README names
    a file that defines it; a bare file name is looked up under the directories the same
    line names before it."""
    stale = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for match in _REFERENCE.finditer(line):
                file, symbol = match.groups()
                bases = ["", *_DIRECTORY.findall(line[: match.start()])]
                found = [REPO / base / file for base in bases if (REPO / base / file).is_file()]
                parts = symbol.split(".")
                if not found or not any(set(parts) <= _defined(path) for path in found):
                    stale.append(f"{doc.relative_to(REPO)}:{number}: {file}:{symbol}")
    assert not stale, "references to nothing:\n" + "\n".join(stale)


def test_no_public_class_name_is_defined_twice() -> None:
    """One definition per public class name across the product's packages, so a name in a
    log, a traceback or the docs means one thing."""
    where: dict[str, list[str]] = {}
    for module, path in SOURCES.items():
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(module)
    twice = {name: modules for name, modules in where.items() if len(modules) > 1}
    assert twice == {}


def test_the_state_stores_tables_are_written_once() -> None:
    """The jobs, rounds, receipts, upload progress and pointers tables are created by
    ``coordinator/state/sql.py:core_schema`` alone; each backend only spells the types."""
    create = re.compile(r"CREATE TABLE (jobs|rounds|receipts|upload_chunks|pointers)\b")
    found = sorted(
        f"{module}: {match.group(1)}"
        for module, path in SOURCES.items()
        for match in create.finditer(path.read_text())
    )
    assert found == [
        f"coordinator.state.sql: {table}"
        for table in sorted(["jobs", "pointers", "receipts", "rounds", "upload_chunks"])
    ]
