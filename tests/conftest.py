"""Every tier: ``tests/gpu`` is collected only when named.

The GPU tests need a CUDA device and fail without one, so ``pytest tests`` (``make
test``, CI) leaves them out; ``make test-gpu`` names the folder (``pytest tests/gpu``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

GPU_TESTS = Path(__file__).resolve().parent / "gpu"


def _names_gpu_tests(config: pytest.Config) -> bool:
    start = config.invocation_params.dir
    for arg in config.args:
        path = (start / arg.split("::", 1)[0]).resolve()
        if path == GPU_TESTS or GPU_TESTS in path.parents:
            return True
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.resolve() == GPU_TESTS and not _names_gpu_tests(config):
        return True
    return None
