"""Prefetch: several downloads in flight, results in their order, leftovers cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from regional_agent.transfer.prefetch import Prefetch


class Fetches:
    """Downloads (the network at the outer edge) that finish when the test says so."""

    def __init__(self, count: int) -> None:
        self.gates = [asyncio.Event() for _ in range(count)]
        self.started: list[int] = []
        self.cancelled: list[int] = []
        self.running = 0
        self.most = 0

    def fetch(self, index: int) -> Callable[[], Awaitable[int]]:
        async def run() -> int:
            self.started.append(index)
            self.running += 1
            self.most = max(self.most, self.running)
            try:
                await self.gates[index].wait()
            except asyncio.CancelledError:
                self.cancelled.append(index)
                raise
            finally:
                self.running -= 1
            if index == 99:
                raise OSError("unreachable")
            return index * 10

        return run

    def all(self) -> list[Callable[[], Awaitable[int]]]:
        return [self.fetch(i) for i in range(len(self.gates))]


async def test_results_come_in_order_with_at_most_window_in_flight() -> None:
    fetches = Fetches(5)
    async with Prefetch(fetches.all(), window=2) as results:
        await asyncio.sleep(0)
        assert fetches.started == [0, 1]
        fetches.gates[1].set()  # the second finishes first; the first is still awaited
        await asyncio.sleep(0)
        assert fetches.started == [0, 1]
        fetches.gates[0].set()
        assert await results.next() == 0
        await asyncio.sleep(0)
        assert fetches.started == [0, 1, 2]
        for gate in fetches.gates:
            gate.set()
        assert [await results.next() for _ in range(4)] == [10, 20, 30, 40]
        with pytest.raises(StopAsyncIteration):
            await results.next()
    assert fetches.most == 2


async def test_window_one_fetches_one_after_another() -> None:
    fetches = Fetches(3)
    for gate in fetches.gates:
        gate.set()
    async with Prefetch(fetches.all(), window=1) as results:
        assert [await results.next() for _ in range(3)] == [0, 10, 20]
    assert fetches.most == 1


async def test_stopping_early_cancels_what_is_still_running() -> None:
    fetches = Fetches(4)
    fetches.gates[0].set()

    async def refuse_the_first() -> None:
        async with Prefetch(fetches.all(), window=3) as results:
            assert await results.next() == 0
            raise RuntimeError("artifact 0 refused")

    with pytest.raises(RuntimeError, match="refused"):
        await refuse_the_first()
    # Those that had started were cancelled (one started just now may never have run).
    assert fetches.cancelled == sorted(set(fetches.started) - {0})
    assert {1, 2} <= set(fetches.cancelled)
    assert fetches.running == 0


async def test_a_failed_fetch_raises_in_its_turn() -> None:
    fetches = Fetches(100)
    failing = [fetches.fetch(0), fetches.fetch(99), fetches.fetch(1)]
    fetches.gates[0].set()
    fetches.gates[99].set()
    async with Prefetch(failing, window=3) as results:
        assert await results.next() == 0
        with pytest.raises(OSError, match="unreachable"):
            await results.next()
    assert fetches.cancelled == [1]


def test_the_window_is_at_least_one() -> None:
    with pytest.raises(ValueError, match="window"):
        Prefetch([], window=0)
