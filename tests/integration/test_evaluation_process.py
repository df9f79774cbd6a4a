"""The coordinator's evaluation process: its own process, and a new one after it died."""

from __future__ import annotations

import os
from concurrent.futures.process import BrokenProcessPool

import pytest

from coordinator.executors import Executors

pytestmark = pytest.mark.integration


async def test_evaluations_run_in_a_process_of_their_own_that_is_replaced_when_it_dies() -> None:
    executors = Executors(compute_threads=1, file_threads=1)
    try:
        child = await executors.evaluate(os.getpid)
        assert child != os.getpid()
        assert await executors.evaluate(os.getpid) == child  # one process, kept
        with pytest.raises(BrokenProcessPool):
            await executors.evaluate(os._exit, 3)
        again = await executors.evaluate(os.getpid)
        assert again not in (child, os.getpid())
    finally:
        executors.shutdown()
