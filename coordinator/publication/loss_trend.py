"""Whether a job's validation loss falls steadily: then its snapshots may come less often (pure).

A snapshot insures the rounds since the last one against a failure. While the held-out
loss falls steadily, training is healthy and each round is like the last, so an auto
snapshot interval is stretched by :data:`STRETCH` (within ``snapshot_max_rounds``).
When the loss rose, or jumps about, or too few rounds were evaluated to tell, the
interval stays what cost and failures make it: a divergence is exactly when the last
good θ is wanted close by.

The rule, over the newest :data:`WINDOW` evaluated versions (at least :data:`MIN_POINTS`):
the loss falls steadily when no step between two of them rises by more than
:data:`NOISE` of the loss, and the last is below the first by more than :data:`NOISE`
of it. A non-finite loss stops the stretch. The verdict carries its reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

__all__ = ["MIN_POINTS", "NOISE", "STRETCH", "WINDOW", "LossTrend", "loss_trend"]

#: How many of the newest evaluations the trend is read from.
WINDOW: Final = 5
#: Fewer evaluations tell nothing.
MIN_POINTS: Final = 4
#: A relative rise this small between two evaluations is noise, not a rise.
NOISE: Final = 0.01
#: The factor the auto snapshot interval is stretched by while the loss falls steadily.
STRETCH: Final = 2


@dataclass(frozen=True, slots=True)
class LossTrend:
    """The factor the snapshot interval is stretched by (1: not), and why."""

    stretch: int
    reason: str


def loss_trend(history: Mapping[int, float]) -> LossTrend:
    """The trend of ``history`` (evaluated version -> validation loss)."""
    versions = sorted(history)[-WINDOW:]
    if len(versions) < MIN_POINTS:
        return LossTrend(1, f"{len(versions)} evaluated round(s), {MIN_POINTS} tell a trend")
    losses = [history[v] for v in versions]
    span = f"rounds {versions[0]}-{versions[-1]}"
    if not all(math.isfinite(x) for x in losses):
        return LossTrend(1, f"a non-finite validation loss in {span}")
    for i in range(1, len(losses)):
        (v0, a), (v1, b) = (versions[i - 1], losses[i - 1]), (versions[i], losses[i])
        if b - a > NOISE * abs(a):
            return LossTrend(
                1, f"the validation loss rose from {a:.4g} (round {v0}) to {b:.4g} (round {v1})"
            )
    first, last = losses[0], losses[-1]
    if first - last <= NOISE * abs(first):
        return LossTrend(1, f"the validation loss stayed near {first:.4g} over {span}")
    return LossTrend(
        STRETCH, f"the validation loss falls steadily ({first:.4g} -> {last:.4g} over {span})"
    )
