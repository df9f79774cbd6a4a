"""Compute utilization of a region, from its workers' training intervals.

Utilization = (the union of the intervals the worker trained) / (the wall time from the
first training start to the last training end). The union, not the sum: with
``overlap: delayed`` a round's training may start while the previous round's
communication is in flight, and overlapping intervals must not count twice. Pure: the
demo and the benchmarks feed it the intervals of :mod:`regional_agent.rounds.timeline`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Utilization:
    """Busy seconds (the union of the intervals) over the span they cover."""

    busy_s: float
    span_s: float
    intervals: int

    @property
    def fraction(self) -> float | None:
        """``busy_s / span_s``; None without a span (no interval, or only instants)."""
        if self.span_s <= 0:
            return None
        return min(1.0, self.busy_s / self.span_s)


def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of ``[start, end]`` intervals."""
    total = 0.0
    current: tuple[float, float] | None = None
    for start, end in sorted(intervals):
        if current is None or start > current[1]:
            if current is not None:
                total += current[1] - current[0]
            current = (start, end)
        else:
            current = (current[0], max(current[1], end))
    if current is not None:
        total += current[1] - current[0]
    return total


def compute_utilization(intervals: Iterable[tuple[float, float]]) -> Utilization:
    """The utilization of training ``intervals`` (start, end), in any order.

    Raises ``ValueError`` for an interval that ends before it starts or is not finite.
    """
    checked = []
    for start, end in intervals:
        if not (math.isfinite(start) and math.isfinite(end)):
            raise ValueError(f"interval ({start}, {end}) is not finite")
        if end < start:
            raise ValueError(f"interval ({start}, {end}) ends before it starts")
        checked.append((start, end))
    if not checked:
        return Utilization(0.0, 0.0, 0)
    span = max(end for _, end in checked) - min(start for start, _ in checked)
    return Utilization(union_seconds(checked), span, len(checked))
