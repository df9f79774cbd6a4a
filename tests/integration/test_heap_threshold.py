"""The mmap threshold the daemons keep (:func:`geofed.heap.keep_mmap_threshold`), in a fresh
interpreter: a process's free heap serves large requests before any mapping, so only a
process that has not run other work shows the threshold alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

_PROBE = """
import ctypes, sys
from geofed.heap import keep_mmap_threshold

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd",
        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

info = ctypes.CDLL(None).mallinfo2
info.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_mmap_threshold({})
first = bytearray(30 << 20)  # freed, it raises glibc's own threshold to its size
del first
before = info().hblkhd
buffer = bytearray(4 << 20)
print(info().hblkhd - before)
"""


def _mapped_growth(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=60, check=True
    )
    return int(done.stdout.strip())


def test_a_buffer_after_a_larger_one_freed_is_mapped_only_with_the_threshold_kept() -> None:
    # Without it the 4 MiB buffer comes from the heap, where freed memory stays resident.
    assert _mapped_growth("glibc") == 0
    assert _mapped_growth("keep") >= 4 << 20
