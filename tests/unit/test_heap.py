"""Freed heap memory goes back to the system when the agent asks (:mod:`geofed.heap`)."""

from __future__ import annotations

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


def test_the_operators_threshold_wins() -> None:
    assert keep_mmap_threshold({"MALLOC_MMAP_THRESHOLD_": "65536"}) is False
    assert keep_mmap_threshold({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}) is False
