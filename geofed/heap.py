"""Giving freed heap memory back to the system after a pass over a model-sized file.

A daemon that streams θ or an artifact through fixed buffers, from the threads of an
executor, frees every buffer it used, but glibc keeps what was freed in each thread's
arena rather than returning it, so the process's resident memory creeps up round after
round. :func:`trim_heap` asks glibc to return it (``malloc_trim(0)``, every arena); on
a C library without it, it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        # The symbols the process already has: the C library it runs on, found without
        # ctypes.util.find_library (which starts ldconfig).
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    found: Callable[[int], int] = trim
    return found


def trim_heap() -> bool:
    """Return freed heap memory to the system; whether any was (False without glibc)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
