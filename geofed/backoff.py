"""Exponential back-off with jitter, and the failure count of one retry loop.

:class:`Backoff` is pure arithmetic: the random source is passed in, so tests get exact
delays, while in production the jitter keeps the daemons of a federation from retrying
in lock-step after a broker (or coordinator) restart. :class:`Retry` is what every retry
loop keeps: its consecutive failures, the wait each one earns, and when a long enough
healthy spell starts the count again. Its sleep, random source and clock are injected,
so a test runs a loop's waits instantly and sees them exactly.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

__all__ = ["Backoff", "Clock", "Retry", "Sleep"]

Sleep = Callable[[float], Awaitable[None]]
Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before retry attempt ``n``: ``initial_s * multiplier**n``, capped.

    ``jitter`` is the fraction of the delay drawn at random: 0.5 gives a delay uniform
    in ``[d/2, d]``, 1.0 is "full jitter" (uniform in ``[0, d]``), 0 none. A connection
    that stays up ``reset_after_s`` counts as healthy and resets the attempt counter
    (:meth:`Retry.recovered`), so a broker that accepts and immediately drops a client
    still sees it back off.
    """

    initial_s: float = 0.5
    max_s: float = 30.0
    multiplier: float = 2.0
    jitter: float = 0.5
    reset_after_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("initial_s", "max_s", "multiplier", "jitter", "reset_after_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"backoff {name} must be a finite number, got {value!r}")
        if self.initial_s <= 0:
            raise ValueError(f"backoff initial_s must be > 0, got {self.initial_s}")
        if self.max_s < self.initial_s:
            raise ValueError(f"backoff max_s {self.max_s} is below initial_s {self.initial_s}")
        if self.multiplier < 1:
            raise ValueError(f"backoff multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"backoff jitter must be in [0, 1], got {self.jitter}")
        if self.reset_after_s < 0:
            raise ValueError(f"backoff reset_after_s must be >= 0, got {self.reset_after_s}")

    def ceiling(self, attempt: int) -> float:
        """The delay before jitter for 0-based ``attempt``."""
        if attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {attempt}")
        # Compare exponents rather than computing a huge power that would overflow.
        limit = math.log(self.max_s / self.initial_s, self.multiplier) if self.multiplier > 1 else 0
        if self.multiplier > 1 and attempt >= limit:
            return self.max_s
        return min(self.max_s, self.initial_s * self.multiplier**attempt)

    def delay(self, attempt: int, rng: random.Random) -> float:
        """The jittered delay for 0-based ``attempt``, drawn from ``rng``."""
        ceiling = self.ceiling(attempt)
        return ceiling * (1.0 - self.jitter * rng.random())


class Retry:
    """The consecutive failures of one retry loop, and the wait each one earns.

    A loop calls :meth:`failed` after each failed attempt for the wait before the next
    one (which it may log first), then :meth:`wait`; :meth:`reset` after a success, or
    :meth:`recovered` when an attempt that stayed healthy long enough ended anyway.
    """

    def __init__(
        self,
        backoff: Backoff,
        *,
        rng: random.Random | None = None,
        sleep: Sleep = asyncio.sleep,
        clock: Clock = time.monotonic,
    ) -> None:
        self.backoff = backoff
        self._rng = rng if rng is not None else random.Random()
        self._sleep = sleep
        self._clock = clock
        self._failures = 0

    @property
    def failures(self) -> int:
        """Consecutive failures counted so far (0 after a success)."""
        return self._failures

    def failed(self) -> float:
        """Count one more failure; return the wait before the next attempt."""
        delay = self.backoff.delay(self._failures, self._rng)
        self._failures += 1
        return delay

    async def wait(self, delay: float) -> None:
        """Sleep ``delay`` seconds (what :meth:`failed` returned) with the injected sleep."""
        await self._sleep(delay)

    def reset(self) -> None:
        """An attempt succeeded: the next failure waits the shortest delay again."""
        self._failures = 0

    def recovered(self, since: float, healthy_after_s: float | None = None) -> bool:
        """Reset if an attempt that began at ``since`` (on the clock) has lasted
        ``healthy_after_s`` (default: the back-off's ``reset_after_s``); say whether."""
        healthy = self.backoff.reset_after_s if healthy_after_s is None else healthy_after_s
        if self._clock() - since < healthy:
            return False
        self._failures = 0
        return True

    def now(self) -> float:
        """The injected clock's time, for the ``since`` of :meth:`recovered`."""
        return self._clock()
