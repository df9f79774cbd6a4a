"""Batches read ahead in a background thread come in the source's order, raise the
source's error where its item would be, and stop their thread when dropped."""

from __future__ import annotations

import gc
import itertools
import threading
from collections.abc import Iterator

import pytest

from geofed.data.prefetch import prefetched


def prefetch_threads() -> int:
    return sum(t.name == "geofed-prefetch" for t in threading.enumerate())


def counting() -> Iterator[int]:
    yield from itertools.count()


def test_items_come_in_order_and_inline_without_depth() -> None:
    assert list(itertools.islice(prefetched(counting(), 3), 100)) == list(range(100))
    assert list(prefetched(iter([1, 2, 3]), 2)) == [1, 2, 3]
    assert list(prefetched(iter([1, 2, 3]), 0)) == [1, 2, 3]


def test_the_source_s_error_comes_where_its_item_would() -> None:
    def failing() -> Iterator[int]:
        yield 1
        raise ValueError("token id 9 is outside the vocabulary")

    stream = prefetched(failing(), 2)
    assert next(stream) == 1
    with pytest.raises(ValueError, match="outside the vocabulary"):
        next(stream)


def test_a_dropped_stream_stops_its_thread() -> None:
    before = prefetch_threads()
    stream = prefetched(counting(), 2)
    assert next(stream) == 0
    assert prefetch_threads() == before + 1
    stream.close()
    assert prefetch_threads() == before
    another = prefetched(counting(), 2)
    next(another)
    del another
    gc.collect()
    assert prefetch_threads() == before
