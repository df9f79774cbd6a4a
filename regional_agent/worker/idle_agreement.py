"""When the ranks of an idle worker group meet to agree on a stop.

Every poll interval rank 0 looks for work; a collective at every poll kept each idle rank
a few per cent busy. So while idle only rank 0 polls (the others wait in the collective)
and the ranks meet at most every :data:`IDLE_AGREE_S`, or at once when rank 0 has work or
a stop to share: a signal to another rank alone (caught while it waits in a meeting) is
acted on at the meeting after, within about twice that.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Final

__all__ = ["IDLE_AGREE_S", "IdleAgreement"]

IDLE_AGREE_S: Final = 0.5


class IdleAgreement:
    """Rank ``rank``'s side of the rule in the module docstring (``clock``: seconds)."""

    def __init__(self, rank: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._rank = rank
        self._clock = clock
        self._agreed_at = -math.inf

    def wait_alone(self, has_work: bool, wants_stop: bool) -> bool:
        """Whether this rank polls again without meeting the others."""
        return (
            self._rank == 0
            and not has_work
            and not wants_stop
            and self._clock() - self._agreed_at < IDLE_AGREE_S
        )

    def agreed(self) -> None:
        """The ranks just met."""
        self._agreed_at = self._clock()
