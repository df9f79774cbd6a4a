"""Reading the next batches in a background thread while the current one trains.

:func:`prefetched` runs an iterator in a thread of its own, at most ``depth`` items
ahead, and yields its items in their order, so the batch at a step is the one the source
gives for it. An exception in the source is raised where its item would have come. When
the consumer stops (the generator is closed or dropped at a round's end), the thread stops
at its next item instead of waiting forever to hand one over.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator, Iterator
from typing import Final, TypeVar

__all__ = ["prefetched"]

T = TypeVar("T")
_POLL_S: Final = 0.05
_ITEM, _END, _ERROR = range(3)


def prefetched(source: Iterator[T], depth: int) -> Generator[T, None, None]:
    """``source``'s items, read up to ``depth`` ahead in a background thread (0: inline)."""
    if depth <= 0:
        yield from source
        return
    handed: queue.Queue[tuple[int, object]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def hand(kind: int, value: object) -> bool:
        while not stop.is_set():
            try:
                handed.put((kind, value), timeout=_POLL_S)
            except queue.Full:
                continue
            return True
        return False

    def produce() -> None:
        try:
            for item in source:
                if not hand(_ITEM, item):
                    return
            hand(_END, None)
        except BaseException as exc:  # raised in the consumer, where the item would be
            hand(_ERROR, exc)

    thread = threading.Thread(target=produce, name="geofed-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = handed.get()
            if kind == _ITEM:
                yield value  # type: ignore[misc]
            elif kind == _END:
                return
            else:
                assert isinstance(value, BaseException)
                raise value
    finally:
        stop.set()
        thread.join(timeout=1.0)  # a source inside a slow read finishes it, then stops
