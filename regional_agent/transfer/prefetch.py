"""Several downloads in flight, consumed in order.

A resync fetches a checkpoint chain: a snapshot, then each update after it. Fetched one
after another over a WAN, every artifact first waits a round trip (or several, while TCP
ramps up); :class:`Prefetch` keeps up to ``window`` of the fetches running while the
caller verifies and applies the results in their order. When the caller stops early (an
artifact is refused) or fails, the fetches still running are cancelled.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from types import TracebackType
from typing import Generic, TypeVar

__all__ = ["Prefetch"]

T = TypeVar("T")


class Prefetch(Generic[T]):
    """Runs ``fetches`` with at most ``window`` at once; :meth:`next` returns them in order.

    Use as ``async with Prefetch(fetches, window) as results: await results.next()``.
    """

    def __init__(self, fetches: Iterable[Callable[[], Awaitable[T]]], window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._fetches: Iterator[Callable[[], Awaitable[T]]] = iter(fetches)
        self._window = window
        self._running: deque[asyncio.Future[T]] = deque()

    async def __aenter__(self) -> Prefetch[T]:
        self._fill()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        running, self._running = list(self._running), deque()
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)
            for task in running:
                if not task.cancelled():
                    task.exception()  # read, so asyncio does not report it as lost

    async def next(self) -> T:
        """The next fetch's result, in order; starts the following one in its slot."""
        if not self._running:
            raise StopAsyncIteration
        result = await self._running.popleft()
        self._fill()
        return result

    def _fill(self) -> None:
        while len(self._running) < self._window:
            fetch = next(self._fetches, None)
            if fetch is None:
                return
            self._running.append(asyncio.ensure_future(fetch()))
