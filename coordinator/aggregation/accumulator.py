"""The open round's deltas, summed as they are accepted, so each is decoded only once.

A job whose aggregation is a plain token-weighted mean (no norm check:
:func:`coordinator.aggregation.robust.folds_on_arrival`) has every accepted delta folded
into a running :class:`~coordinator.aggregation.weighted.WeightedSum` right after its acceptance
commits, decoded again from its durable stream piece by piece, its chunks side by side
(:meth:`~coordinator.aggregation.weighted.WeightedSum.add_verified`,
:func:`geofed.codec.stored.decode_stored`): its upload's verification
(:func:`coordinator.intake.delta_stream.verify_and_store`) checked every value, and no
decoded copy of a delta is held, so that uploads verified side by side cost no memory of
the model's size. The engine folds under its lock, so the sum's order is the round's
recorded arrival order; at quorum only the division, the outer step and the update's
encoding remain.

The sum lives in memory only. Whenever it cannot stand for the round exactly (a fold
failed or was cancelled, the coordinator restarted, the round was re-opened, the weights
differ from the receipts'), :meth:`RoundAccumulator.take` says so and why, and the
publisher decodes the durable deltas in the same arrival order instead: the same bits.
Folding is CPU work: call :meth:`RoundAccumulator.fold` in a worker thread.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from coordinator.aggregation.weighted import Feed, WeightedSum

__all__ = ["RoundAccumulator", "RoundKey"]

#: Which round instance a sum belongs to: (round, the time it opened). A round opened
#: again after a restore from an older backup has the same number but not the same key.
RoundKey = tuple[int, float]


class RoundAccumulator:
    """One round's running weighted sum of accepted deltas (see the module docstring)."""

    def __init__(self, key: RoundKey, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """``shapes``: the round's tensors (``JobContext.round_shapes``: a streaming
        round's fragment), as every delta of the round names them."""
        self.key = key
        self._shapes = dict(shapes)
        self._sum: WeightedSum | None = None
        self._lock = threading.Lock()
        self._abandoned = ""

    @property
    def regions(self) -> tuple[str, ...]:
        """The regions folded so far, in the order they were folded."""
        return self._sum.regions if self._sum is not None else ()

    def fold(self, region: str, weight: float, feed: Feed) -> None:
        """Add ``weight x`` the region's verified delta (blocking), as ``feed`` decodes it
        piece by piece.

        A failed fold abandons the sum (its error propagates), since a half-added region
        would make it wrong.
        """
        with self._lock:
            if self._abandoned:
                return
            try:
                if self._sum is None:
                    self._sum = WeightedSum(self._shapes)  # one model of zeros: off the loop
                self._sum.add_verified(region, weight, feed)
            except BaseException as exc:
                self._abandoned = f"folding {region}'s delta failed: {exc}"
                raise

    def abandon(self, reason: str) -> None:
        """Never use this sum (a fold was cancelled, or failed where it was awaited)."""
        if not self._abandoned:
            self._abandoned = reason

    def take(
        self, order: Sequence[str], weights: Mapping[str, float]
    ) -> tuple[WeightedSum | None, str]:
        """The sum, if it holds exactly the regions of ``order``, in that order, with
        ``weights``; otherwise None. Either way, the reason. The sum is handed over once.
        Never waits: a fold still running (its await was cancelled) makes it None."""
        if not self._lock.acquire(blocking=False):
            return None, "a fold is still running"
        try:
            if self._abandoned:
                return None, self._abandoned
            held = self._sum
            if held is None:
                return None, "no delta was folded"
            if held.regions != tuple(order):
                return None, f"folded {list(held.regions)}, the round takes {list(order)}"
            if dict(held.weights) != {region: float(weights[region]) for region in order}:
                return None, "the folded weights differ from the receipts' tokens"
            self._sum = None
            self._abandoned = "handed over"
            return held, f"{len(order)} delta(s) folded as they arrived"
        finally:
            self._lock.release()
