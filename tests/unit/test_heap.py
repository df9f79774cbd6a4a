"""Freed heap memory goes back to the system when the agent asks (:mod:`geofed.heap`)."""

from __future__ import annotations

import os
import threading

from geofed.heap import keep_mmap_threshold, trim_heap


def test_memory_freed_in_another_thread_is_returned() -> None:
    def churn() -> None:
        # Below glibc's mmap threshold: these land in the thread's arena, not in mappings.
        kept = [bytearray(100_000) for _ in range(400)]
        del kept

    worker = threading.Thread(target=churn)
    worker.start()
    worker.join()
    assert trim_heap() is True  # glibc (Debian, the images we ship) had pages to return


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_buffers_freed_after_a_larger_one_leave_nothing_resident() -> None:
    assert keep_mmap_threshold({}) is True
    before = _resident_bytes()
    # Freed, a mapped 30 MiB buffer raises glibc's own threshold to its size (and the
    # heap's trim threshold to twice that): the smaller buffers after it would come from
    # the heap and stay resident once freed (47 of their 48 MiB, measured without the
    # threshold kept).
    first = bytearray(30 * 2**20)
    del first
    buffers = [bytearray(4 * 2**20) for _ in range(12)]
    del buffers
    assert _resident_bytes() - before < 20 * 2**20


def test_the_operators_threshold_wins() -> None:
    assert keep_mmap_threshold({"MALLOC_MMAP_THRESHOLD_": "65536"}) is False
    assert keep_mmap_threshold({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}) is False
