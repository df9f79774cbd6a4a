"""The sealing pipeline: results in order, threads only when there is more than one job."""

from __future__ import annotations

import functools
import threading

import pytest

from geofed.codec.layout import ChunkSlot
from geofed.codec.pipeline import Pipeline
from geofed.codec.wire import Sealed


def run(workers: int, jobs: int) -> tuple[list[int], set[str]]:
    order: list[int] = []
    threads: set[str] = set()

    def job(index: int) -> Sealed:
        threads.add(threading.current_thread().name)
        return Sealed(bytes([index]), b"")

    def done(slot: ChunkSlot, sealed: Sealed) -> None:
        assert sealed.data == bytes([slot.index])
        order.append(slot.index)

    with Pipeline(workers) as pipeline:
        for index in range(jobs):
            pipeline.submit(ChunkSlot(index, 0, 0, 1), functools.partial(job, index), done)
    return order, threads


@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("jobs", [0, 1, 2, 9])
def test_results_come_back_in_order(workers: int, jobs: int) -> None:
    order, _ = run(workers, jobs)
    assert order == list(range(jobs))


def test_a_single_job_is_sealed_inline_without_a_pool() -> None:
    _, threads = run(4, 1)
    assert threads == {threading.current_thread().name}
    _, threads = run(4, 6)
    assert any(name.startswith("geofed-codec") for name in threads)


def test_an_error_drops_the_deferred_job() -> None:
    ran: list[int] = []

    def job() -> Sealed:
        ran.append(0)
        return Sealed(b"", b"")

    def quantize_then_fail() -> None:
        with Pipeline(2) as pipeline:
            pipeline.submit(ChunkSlot(0, 0, 0, 1), job, lambda slot, sealed: None)
            raise RuntimeError("quantizing failed")

    with pytest.raises(RuntimeError, match="quantizing failed"):
        quantize_then_fail()
    assert ran == []
