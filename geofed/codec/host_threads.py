"""Keeping the codec's host tensor ops on the calling thread.

The codec's CPU work is many short torch ops on cache-sized tiles
(:mod:`geofed.codec.quantize`). With torch's intra-op threads, each of them forks and
joins an OpenMP team; on a busy machine (other processes, or the coordinator's other
compute threads decoding side by side) every join waits for a descheduled thread while
the rest spin: on 2 loaded cores, encoding plus decoding 1M int8 values with 2 torch
threads took from 5 to over 50 times the CPU time of one thread. The codec therefore
runs each chunk's ops on its own thread (:func:`one_thread`) and gets its parallelism
from chunks and streams processed side by side (``workers``, thread pools), which
sha256, zstd and torch allow: they release the GIL. The bits are the same either way
(elementwise ops and exact max/min reductions).

:func:`one_thread` sets the calling thread's OpenMP thread count through the OpenMP
runtime torch loaded, not ``torch.set_num_threads``, which also changes the count that
threads starting meanwhile inherit. Where torch runs without such a runtime it does
nothing. :func:`usable_cpus` is how many threads such work can keep busy.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

import torch

__all__ = ["one_thread", "usable_cpus"]

_RUNTIMES: Final = ("libgomp", "libiomp5", "libomp")
_MAPS: Final = Path("/proc/self/maps")


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


_lock = threading.Lock()
_resolved = False
_setter: Callable[[int], None] | None = None


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the enclosed torch CPU ops on the calling thread alone; other threads keep theirs."""
    threads = torch.get_num_threads()  # also settles torch's own count for this thread first
    setter = _omp_setter() if threads > 1 else None
    if setter is None:
        yield
        return
    setter(1)
    try:
        yield
    finally:
        setter(threads)


def _omp_setter() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the OpenMP runtime torch uses, checked once; or None."""
    global _resolved, _setter
    with _lock:
        if not _resolved:
            _setter = _find_setter()
            _resolved = True
        return _setter


def _find_setter() -> Callable[[int], None] | None:
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    for path in _loaded_runtimes():
        try:
            runtime = ctypes.CDLL(path)
            function, current = runtime.omp_set_num_threads, runtime.omp_get_max_threads
        except (OSError, AttributeError):
            continue
        function.argtypes, function.restype = [ctypes.c_int], None
        current.argtypes, current.restype = [], ctypes.c_int
        before = current()
        function(1)
        # Only the runtime torch's own thread count reads is the right one.
        works = torch.get_num_threads() == 1
        function(before)
        if works:
            return function
    return None


def _loaded_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process, torch's own first."""
    try:
        lines = _MAPS.read_text().splitlines()
    except OSError:
        return []
    paths = {
        line.split()[-1]
        for line in lines
        if "/" in line and any(name in line.rsplit("/", 1)[-1] for name in _RUNTIMES)
    }
    torch_dir = str(Path(torch.__file__).parent)
    return sorted(paths, key=lambda path: (not path.startswith(torch_dir), path))
