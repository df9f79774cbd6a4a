"""Every tier: ``tests/gpu`` is collected only when named; torch runs single-threaded.

The GPU tests need a CUDA device and fail without one, so ``pytest tests`` (``make
test``, CI) leaves them out; ``make test-gpu`` names the folder (``pytest tests/gpu``).

``OMP_NUM_THREADS=1`` (unless the environment sets it) holds for the pytest processes and
every process a test starts, as the demo's daemons and the workers already run: two pytest
workers share two cores with the daemons they start, and a torch process's idle OpenMP
threads spin on a core another process needs (the unit tier took a third more CPU time
with torch's default of one thread a core). A test about threads sets its own count.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Before torch is first imported here or in a child: OpenMP reads it once, at start.
os.environ.setdefault("OMP_NUM_THREADS", "1")

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
