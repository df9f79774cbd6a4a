"""``pytest tests`` (``make test``, CI) leaves ``tests/gpu`` out; naming it collects it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import GPU_TESTS, pytest_ignore_collect

REPO_ROOT = GPU_TESTS.parents[1]


def _config(*args: str, cwd: Path = REPO_ROOT) -> Any:
    return SimpleNamespace(args=list(args), invocation_params=SimpleNamespace(dir=cwd))


@pytest.mark.parametrize(
    "args", [(), ("tests",), ("tests/unit", "tests/integration"), (str(REPO_ROOT),)]
)
def test_runs_that_do_not_name_the_gpu_tests_skip_their_folder(args: tuple[str, ...]) -> None:
    assert pytest_ignore_collect(GPU_TESTS, _config(*args)) is True


@pytest.mark.parametrize(
    ("args", "cwd"),
    [
        (("tests/gpu",), REPO_ROOT),
        (("tests/gpu/test_gpu_demo.py::test_demo_runs_two_rounds_on_the_gpu",), REPO_ROOT),
        (("gpu",), REPO_ROOT / "tests"),
    ],
)
def test_naming_the_gpu_tests_collects_them(args: tuple[str, ...], cwd: Path) -> None:
    assert pytest_ignore_collect(GPU_TESTS, _config(*args, cwd=cwd)) is None


def test_other_folders_are_left_to_pytest() -> None:
    assert pytest_ignore_collect(REPO_ROOT / "tests" / "unit", _config("tests")) is None
