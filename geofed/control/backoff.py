"""Exponential back-off with jitter, for reconnecting to the broker and other retries.

Pure arithmetic: the random source is passed in, so tests get exact delays, while in
production the jitter keeps the daemons of a federation from retrying in lock-step
after a broker (or coordinator) restart.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before reconnection attempt ``n``: ``initial_s * multiplier**n``, capped.

    ``jitter`` is the fraction of the delay drawn at random: 0.5 gives a delay uniform
    in ``[d/2, d]``, 1.0 is "full jitter" (uniform in ``[0, d]``). A connection that
    stays up ``reset_after_s`` counts as healthy and resets the attempt counter, so a
    broker that accepts and immediately drops a client still sees it back off.
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
