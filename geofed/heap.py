"""Giving freed heap memory back to the system: model-sized buffers, and arenas.

glibc maps a large buffer of its own and unmaps it when freed, but only above its mmap
threshold, which it raises to the size of every mapped buffer freed (up to 32 MiB): after
the first buffers, a process's decoded tensors, all-gathered parameters and unsharded
gradients come from the heap instead, where freed memory stays resident, and its peak
grows by several times the model (a CPU rank of an FSDP group peaked at 990 MiB for a
97 MiB model, 668 MiB with the threshold kept at 128 KiB).

- The daemons keep the threshold where glibc starts it, 128 KiB
  (:func:`keep_mmap_threshold`): they stream θ and artifacts through fixed buffers, not
  in a tight loop, so mapping each costs nothing measurable.
- A rank allocates and frees its buffers every step, and a fresh mapping is paid in page
  faults: the worker launcher sets :data:`RANK_HEAP_ENV` in the ranks' environment (a 4 MiB
  threshold, and transparent huge pages for mapped buffers where the kernel gives them on
  request), which cost 7-13% of a CPU step and cut a rank's peak by 20-30% in the
  measurements of docs/operations.md. On a GPU the training state is not in the heap.

An operator's own ``MALLOC_MMAP_THRESHOLD_`` or ``GLIBC_TUNABLES`` wins over both.

A daemon that streams θ or an artifact through fixed buffers, from the threads of an
executor, frees every buffer it used, but glibc keeps what was freed in each thread's
arena rather than returning it, so the process's resident memory creeps up round after
round. :func:`trim_heap` asks glibc to return it (``malloc_trim(0)``, every arena); on
a C library without it, it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable, Mapping

#: glibc's starting mmap threshold: buffers of this size and above are mapped, and
#: unmapped when freed.
MMAP_THRESHOLD_BYTES = 128 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h
_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"

#: What a rank's environment gets unless it sets the variable itself.
RANK_HEAP_ENV: dict[str, str] = {
    _THRESHOLD_ENV: str(4 * 2**20),
    "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
}


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        # The symbols the process already has: the C library it runs on, found without
        # ctypes.util.find_library (which starts ldconfig).
        return ctypes.CDLL(None)
    except OSError:
        return None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    found: Callable[[int], int] = trim
    return found


def trim_heap() -> bool:
    """Return freed heap memory to the system; whether any was (False without glibc)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


def keep_mmap_threshold(environ: Mapping[str, str] = os.environ) -> bool:
    """Keep glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES` for the rest of the
    process, so that model-sized buffers go back to the system when freed; whether it
    was set (False without glibc's ``mallopt``, or when the environment sets a threshold
    of its own, which glibc has applied already)."""
    if _THRESHOLD_ENV in environ or "mmap_threshold" in environ.get("GLIBC_TUNABLES", ""):
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def rank_heap_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of :data:`RANK_HEAP_ENV` that ``environ`` (a rank's environment
    before them) does not set."""
    return {name: value for name, value in RANK_HEAP_ENV.items() if name not in environ}
