"""Group commit: concurrent requests share one durable commit, each answered after it.

A chunk PUT may be answered only once its frame is durable (fsync'd and recorded in
SQLite). Committing each on its own costs a directory fsync and a SQLite commit (a WAL
fsync) per chunk; when a region sends several chunks at once, :class:`GroupCommit` lets
them share one. The first item to arrive while no commit runs starts a batch after
``window_s`` (so items arriving together join it); items arriving while a commit runs
form the next batch, which starts as soon as that commit ends. Every :meth:`submit`
returns only once the commit covering its item has finished, with that item's own
outcome: a batch commit returns one result or exception per item, and an exception from
the batch commit as a whole fails every item of that batch (none is acknowledged).

The batching itself (:class:`Batches`) is pure: no clock, no I/O. The commit function
and the sleep are injected, so the tests run it on a fake commit and no real time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from geofed.backoff import Sleep

__all__ = ["Batches", "CommitStats", "GroupCommit"]

T = TypeVar("T")
R = TypeVar("R")

CommitBatch = Callable[[Sequence[T]], Awaitable[Sequence[R | BaseException]]]
"""Commits items together; returns one result (or the item's own exception) per item."""


@dataclass(slots=True)
class Batches(Generic[T]):
    """Which waiting items the next commit takes (pure state, no I/O).

    ``add`` says whether the caller must start a committer (none is running);
    ``take`` removes the next batch (at most ``max_batch`` items, oldest first);
    ``finished`` says whether the committer goes on (items arrived meanwhile) or stops.
    """

    max_batch: int
    waiting: list[T] = field(default_factory=list)
    running: bool = False

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")

    def add(self, item: T) -> bool:
        """Queue ``item``; True when no committer runs and the caller must start one."""
        self.waiting.append(item)
        if self.running:
            return False
        self.running = True
        return True

    def take(self) -> list[T]:
        batch, self.waiting = self.waiting[: self.max_batch], self.waiting[self.max_batch :]
        return batch

    def take_all(self) -> list[T]:
        """Remove every waiting item (the committer stopped); a new item starts a new one."""
        batch, self.waiting = self.waiting, []
        self.running = False
        return batch

    def finished(self) -> bool:
        """A commit ended: True when items wait for the next one, False when the committer stops."""
        if self.waiting:
            return True
        self.running = False
        return False


@dataclass(slots=True)
class CommitStats:
    """Counters since start: commits run and items they covered."""

    commits: int = 0
    items: int = 0
    largest: int = 0


@dataclass(slots=True)
class _Waiter(Generic[T, R]):
    item: T
    future: asyncio.Future[R]


class GroupCommit(Generic[T, R]):
    """Commits submitted items in batches (see the module docstring)."""

    def __init__(
        self,
        commit: CommitBatch[T, R],
        *,
        window_s: float = 0.0,
        max_batch: int = 64,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        if not window_s >= 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        self._commit = commit
        self._window_s = window_s
        self._sleep = sleep
        self._batches: Batches[_Waiter[T, R]] = Batches(max_batch)
        self._committer: asyncio.Task[None] | None = None
        self.stats = CommitStats()

    async def submit(self, item: T) -> R:
        """Return ``item``'s result once a commit covering it has finished (or raise its error).

        A caller cancelled while waiting does not withdraw the item: a commit may already
        have started with it, and committing a duplicate is harmless.
        """
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)
        if self._batches.add(_Waiter(item, future)):
            self._committer = asyncio.create_task(self._run(), name="group-commit")
        return await asyncio.shield(future)

    async def _run(self) -> None:
        try:
            # The window lets items that arrive together share the first commit; later
            # ones gather while a commit runs, so they need no window of their own.
            await self._sleep(self._window_s)
            while True:
                await self._commit_batch(self._batches.take())
                if not self._batches.finished():
                    return
        except BaseException as exc:
            # Cancelled (shutdown) or broken: nothing waiting may hang, none is acknowledged.
            stranded = self._batches.take_all()
            for waiter in stranded:
                _fail(waiter.future, exc)
            raise

    async def _commit_batch(self, batch: list[_Waiter[T, R]]) -> None:
        self.stats.commits += 1
        self.stats.items += len(batch)
        self.stats.largest = max(self.stats.largest, len(batch))
        try:
            outcomes = _checked(await self._commit([w.item for w in batch]), len(batch))
        except Exception as exc:  # every item of the batch fails with it
            for waiter in batch:
                _fail(waiter.future, exc)
            return
        except BaseException as exc:
            for waiter in batch:
                _fail(waiter.future, exc)
            raise
        for waiter, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                _fail(waiter.future, outcome)
            elif not waiter.future.done():
                waiter.future.set_result(outcome)


def _checked(outcomes: Sequence[R | BaseException], count: int) -> Sequence[R | BaseException]:
    if len(outcomes) != count:
        raise RuntimeError(f"a batch commit returned {len(outcomes)} outcomes for {count} items")
    return outcomes


def _fail(future: asyncio.Future[R], exc: BaseException) -> None:
    if future.done():
        return
    if isinstance(exc, asyncio.CancelledError):
        future.cancel()
    else:
        future.set_exception(exc)


def _retrieve(future: asyncio.Future[R]) -> None:
    # A caller cancelled while waiting never reads its outcome; reading it here keeps
    # asyncio from logging "exception was never retrieved".
    if not future.cancelled():
        future.exception()
