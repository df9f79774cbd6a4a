"""A small stdlib-shaped source tree for the charlm corpus and task tests."""

from __future__ import annotations

from pathlib import Path

#: Units of the fake tree and the one letter each unit's files are made of.
FAKE_UNITS = {
    **{f"pkg{chr(c)}": chr(c) for c in range(ord("a"), ord("k"))},
    **{f"mod{chr(c)}": chr(c) for c in range(ord("k"), ord("o"))},
}


def make_fake_stdlib(root: Path) -> Path:
    """Write a small stdlib-shaped tree: each unit's files are one repeated letter.

    Packages ``pkga``..``pkgj`` hold six files each, ``modk.py``..``modn.py`` are
    top-level modules; files that must never be read are made of ``Z``.
    """
    root.mkdir(parents=True, exist_ok=True)
    for index, (unit, letter) in enumerate(sorted(FAKE_UNITS.items())):
        if unit.startswith("pkg"):
            (root / unit).mkdir(parents=True)
            for k in range(6):
                name = "__init__.py" if k == 0 else f"part{k}.py"
                body = letter * (150 + 41 * k + 13 * index) + "\n"
                (root / unit / name).write_text(body)
        else:
            (root / f"{unit}.py").write_text(letter * (300 + 29 * index) + "\n")
    for excluded in [
        "site-packages/thirdparty/__init__.py",
        "test/test_everything.py",
        "pkga/tests/test_a.py",
        "pkgb/__pycache__/part1.py",
    ]:
        (root / excluded).parent.mkdir(parents=True, exist_ok=True)
        (root / excluded).write_text("Z" * 500)
    (root / "README.txt").write_text("Z" * 500)
    (root / "pkgc" / "empty.py").write_text("")
    return root
