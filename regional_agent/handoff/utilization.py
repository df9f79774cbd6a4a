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


def merged_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``[start, end]`` intervals as disjoint intervals, in order."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of ``[start, end]`` intervals."""
    return sum(end - start for start, end in merged_intervals(intervals))


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
