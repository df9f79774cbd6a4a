"""The coordinator's pools: the compute pool runs one job per usable CPU at once."""

from __future__ import annotations

import asyncio
import functools
import os
import threading

import pytest

from coordinator.executors import Executors, side_by_side
from geofed.codec.host_threads import usable_cpus


def test_usable_cpus_is_the_affinity_mask() -> None:
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    assert usable_cpus() == (expected or os.cpu_count() or 1)


def test_compute_pool_runs_a_job_per_usable_cpu_at_once() -> None:
    width = max(2, usable_cpus())
    # Breaks (BrokenBarrierError) unless `width` jobs run side by side.
    together = threading.Barrier(width, timeout=10)
    executors = Executors(file_threads=1)

    async def main() -> list[int]:
        return await asyncio.gather(*(executors.compute(together.wait) for _ in range(width)))

    try:
        assert sorted(asyncio.run(main())) == list(range(width))
    finally:
        executors.shutdown()


def test_compute_threads_can_be_set() -> None:
    executors = Executors(compute_threads=1, file_threads=1)
    seen: set[str] = set()

    async def main() -> None:
        for _ in range(3):
            seen.add(await executors.compute(lambda: threading.current_thread().name))

    try:
        asyncio.run(main())
    finally:
        executors.shutdown()
    assert len(seen) == 1


def test_side_by_side_runs_every_job_and_raises_the_first_error_after_all() -> None:
    done: list[int] = []
    lock = threading.Lock()

    def job(index: int) -> None:
        with lock:
            done.append(index)
        if index in (3, 5):
            raise ValueError(f"part {index} failed")

    side_by_side([functools.partial(job, i) for i in range(8)][:1])
    assert done == [0]
    done.clear()
    with pytest.raises(ValueError, match="part 3 failed"):
        side_by_side([functools.partial(job, i) for i in range(8)])
    assert sorted(done) == list(range(8))


def test_side_by_side_uses_several_threads() -> None:
    width = min(2, usable_cpus())
    together = threading.Barrier(width, timeout=10)
    names: set[str] = set()

    def job() -> None:
        names.add(threading.current_thread().name)
        together.wait()

    side_by_side([job] * width)
    assert len(names) == width
