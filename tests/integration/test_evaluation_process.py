"""The coordinator's evaluation process: its own process, and a new one after it died."""

from __future__ import annotations

import os
import time
from concurrent.futures.process import BrokenProcessPool

import pytest

from coordinator.executors import Executors

pytestmark = pytest.mark.integration

#: Which of the coordinator's modules, and of the libraries only its daemon uses, a
#: process has imported.
LOADED = (
    "sorted(name for name in __import__('sys').modules"
    " if name.split('.')[0] in ('coordinator', 'aiohttp', 'psycopg', 'cryptography'))"
)


async def test_evaluations_run_in_a_process_of_their_own_that_is_replaced_when_it_dies() -> None:
    executors = Executors(compute_threads=1, file_threads=1)
    try:
        child = await executors.evaluate(os.getpid)
        assert child != os.getpid()
        assert await executors.evaluate(os.getpid) == child  # one process, kept
        # A fresh interpreter, importing what it evaluates with and not the daemon (HTTP,
        # the state store, the codec). ``eval`` is the probe: a builtin imports nothing.
        loaded = await executors.evaluate(eval, LOADED)
        assert loaded == [
            "coordinator",
            "coordinator.memory_budget",
            "coordinator.publication",
            "coordinator.publication.evaluation_process",
        ], loaded
        with pytest.raises(BrokenProcessPool):
            await executors.evaluate(os._exit, 3)
        again = await executors.evaluate(os.getpid)
        assert again not in (child, os.getpid())
    finally:
        executors.shutdown()


def _hold(mib: int) -> int:
    """In the evaluation process: hold ``mib`` MiB (touched) for a moment."""
    held = bytearray(mib << 20)
    for offset in range(0, len(held), 4096):
        held[offset] = 1
    time.sleep(1.0)  # the budget's watch samples every 50 ms
    return len(held)


async def test_an_evaluation_past_the_memory_budget_ends_its_process_not_the_coordinator(
    capfd: pytest.CaptureFixture[str],
) -> None:
    executors = Executors(compute_threads=1, file_threads=1, evaluation_max_bytes=768 << 20)
    try:
        assert await executors.evaluate(_hold, 64) == 64 << 20  # within: served
        with pytest.raises(BrokenProcessPool):
            await executors.evaluate(_hold, 1024)
        said = capfd.readouterr().err
        assert "the coordinator's evaluation process: resident memory" in said, said
        assert "(limits.max_task_bytes); stopping" in said
        assert await executors.evaluate(_hold, 64) == 64 << 20  # a new process serves on
    finally:
        executors.shutdown()
