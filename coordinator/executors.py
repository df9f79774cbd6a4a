"""Where blocking work runs, so the event loop never blocks.

- ``store``: one thread for every state-store call (SQLite wants one writer; the store's
  calls are short and serialised anyway).
- ``compute``: a pool for codec and torch work (decoding, aggregation, encoding), one
  thread per usable CPU (:func:`geofed.codec.host_threads.usable_cpus`) by default:
  sha256, zstd and torch release the GIL, so the deltas of a round's regions are
  verified and decoded side by side; after each call the heap memory it freed goes back
  to the system.
- ``files``: a pool for file I/O (spooling chunks with fsync, serving blob metadata).
- ``parse``: one thread for parsing and validating request bodies (job specs), so a
  hostile body never runs on the event loop, bodies are parsed one at a time, and they
  never take the compute pool from aggregation.
- ``evaluation``: one process of its own (spawned at the first use) for evaluating global
  parameters when the coordinator evaluates them, so an evaluation never competes with
  aggregation, uploads or publication for the compute pool or the GIL; it ends itself
  past its memory budget (:func:`coordinator.memory_budget.keep_within`).

:meth:`Executors.shutdown` waits for work already running, so a SIGTERM lets in-flight
writes finish; queued work that has not started is dropped (every write is atomic, so
dropping one before it starts loses nothing acknowledged).
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import ParamSpec, TypeVar

from coordinator.publication.evaluation_process import evaluation_budget
from geofed.codec.host_threads import usable_cpus
from geofed.heap import trim_heap

__all__ = ["Executors", "side_by_side"]


P = ParamSpec("P")
T = TypeVar("T")


_cpu_pool: ThreadPoolExecutor | None = None
_cpu_pool_lock = threading.Lock()


def side_by_side(jobs: Sequence[Callable[[], None]]) -> None:
    """Run ``jobs`` on a process-wide pool of one thread per usable CPU; wait for all.

    Blocking, for work already off the event loop that splits into independent parts
    (torch releases the GIL). A job must not call this itself: the pool could fill up
    with jobs waiting for their parts. The first error is raised once all have ended.
    """
    global _cpu_pool
    if len(jobs) <= 1:
        for job in jobs:
            job()
        return
    with _cpu_pool_lock:
        if _cpu_pool is None:
            _cpu_pool = ThreadPoolExecutor(usable_cpus(), thread_name_prefix="geofed-cpu")
        pool = _cpu_pool
    futures = [pool.submit(job) for job in jobs]
    for future in futures:
        future.exception()  # wait for every part before raising any error
    for future in futures:
        future.result()


class Executors:
    """The coordinator's thread pools (see the module docstring)."""

    def __init__(
        self,
        *,
        compute_threads: int | None = None,
        file_threads: int = 4,
        evaluation_max_bytes: int | None = None,
    ) -> None:
        """``compute_threads``: the compute pool's size; by default one per usable CPU,
        and at least 2 so a long publication never holds up every upload's verification.
        ``evaluation_max_bytes``: the evaluation process ends itself past that resident
        memory (``limits.max_task_bytes``; None: unbounded)."""
        self._evaluation_max_bytes = evaluation_max_bytes
        if compute_threads is None:
            compute_threads = max(2, usable_cpus())
        self._store = ThreadPoolExecutor(1, thread_name_prefix="geofed-store")
        self._compute = ThreadPoolExecutor(compute_threads, thread_name_prefix="geofed-compute")
        self._files = ThreadPoolExecutor(file_threads, thread_name_prefix="geofed-files")
        self._parse = ThreadPoolExecutor(1, thread_name_prefix="geofed-parse")
        self._evaluation: ProcessPoolExecutor | None = None

    async def db(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a state-store call in the store thread (callers go through ``AsyncStore``)."""
        return await self._run(self._store, fn, *args, **kwargs)

    async def compute(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run codec or torch work in the compute pool, then give the heap memory it freed
        back to the system (:func:`geofed.heap.trim_heap`: a model-sized pass leaves its
        buffers in the thread's arena otherwise, and the coordinator's memory creeps up)."""
        return await self._run(self._compute, _then_trim, functools.partial(fn, *args, **kwargs))

    async def files(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run file I/O in the file pool."""
        return await self._run(self._files, fn, *args, **kwargs)

    async def parse(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Parse and validate a request body in the parse thread."""
        return await self._run(self._parse, fn, *args, **kwargs)

    async def evaluate(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run an evaluation in the evaluation process (``fn`` and its arguments pickle).

        A process that died (killed, out of memory, or ended itself past its memory
        budget) fails the evaluations it had; the next one starts a new process.
        """
        if self._evaluation is None:
            # Spawned, not forked: the coordinator's threads and event loop stay behind.
            self._evaluation = ProcessPoolExecutor(
                1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=evaluation_budget,
                initargs=(self._evaluation_max_bytes,),
            )
        pool = self._evaluation
        try:
            return await self._run(pool, fn, *args, **kwargs)
        except BrokenProcessPool:
            if self._evaluation is pool:
                self._evaluation = None
                pool.shutdown(wait=False, cancel_futures=True)
            raise

    async def _run(
        self, pool: Executor, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        """Wait for running work and drop queued work: parse, compute, files, then the store."""
        if self._evaluation is not None:
            self._evaluation.shutdown(wait=True, cancel_futures=True)
        self._parse.shutdown(wait=True, cancel_futures=True)
        self._compute.shutdown(wait=True, cancel_futures=True)
        self._files.shutdown(wait=True, cancel_futures=True)
        self._store.shutdown(wait=True, cancel_futures=True)


def _then_trim(work: Callable[[], T]) -> T:
    try:
        return work()
    finally:
        trim_heap()
