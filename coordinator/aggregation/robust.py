"""Aggregation that one bad or malicious region cannot dominate. Pure math, streaming.

Two defences, chosen per job (:class:`~coordinator.aggregation.config.AggregationConfig`):

**Norm check.** A first pass decodes each region's delta once, alone, and takes its L2
norm. :func:`judge_norms` compares every norm with the round's median norm: above
``max_norm_ratio`` x median a delta is scaled down to that norm (``clip``) or left out of
the round (``refuse``); each verdict names the region and its reason. The median region
is never above it, so a round always keeps a delta. The scale must be known before a
region's first value is combined, hence the separate pass: one more decode per delta,
never more than one region's chunk in memory.

**Coordinate-wise rule.** ``mean`` is the token-weighted
:func:`coordinator.aggregation.weighted.aggregate`
(bit for bit the same when nothing is clipped). ``median`` and ``trimmed_mean`` need every
region's value of a coordinate at once: :func:`lockstep` decodes the regions' streams side
by side, piece by piece, and combines the elements they all hold, so memory is R x one
chunk plus the result, not R x the model. Both are unweighted. The median of an even
count is the midpoint of the two middle values; ``trimmed_mean`` drops
floor(trim_fraction x R) values at each end. Sums run in a fixed order (sorted values),
so a restarted coordinator recomputes the same bits.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from coordinator.aggregation.config import AggregationConfig, AggregationRule, NormCheck
from coordinator.aggregation.weighted import (
    AggregationError,
    PieceLike,
    aggregate,
    check_coverage,
    check_piece,
)

__all__ = [
    "Combined",
    "NormVerdict",
    "ScaledPiece",
    "combine",
    "coordinate_statistic",
    "folded",
    "folds_on_arrival",
    "judge_norms",
    "lockstep",
    "region_norm",
]

PieceSource = Callable[[], Iterable[PieceLike]]
Action = Literal["kept", "clipped", "refused"]


@dataclass(frozen=True, slots=True)
class NormVerdict:
    """What the norm check did with one region's delta, and why."""

    region: str
    norm: float
    median: float
    action: Action
    scale: float
    reason: str

    def record(self) -> dict[str, object]:
        """The JSON form, as the round's audit entry carries it."""
        return {
            "region": self.region,
            "action": self.action,
            "norm": self.norm,
            "median": self.median,
            "scale": self.scale,
            "reason": self.reason,
        }


def judge_norms(
    norms: Mapping[str, float], check: NormCheck, max_ratio: float
) -> list[NormVerdict]:
    """Each region's verdict, in sorted region order (see the module docstring)."""
    if not norms:
        raise AggregationError("no region to judge")
    median = statistics.median(norms.values())
    bound = max_ratio * median
    verdicts = []
    for region in sorted(norms):
        norm = norms[region]
        if check == "off" or norm <= bound:
            verdicts.append(NormVerdict(region, norm, median, "kept", 1.0, "within bound"))
            continue
        ratio = math.inf if median == 0 else norm / median
        reason = (
            f"L2 norm {norm:.6g} is {ratio:.3g} x the round's median {median:.6g}; "
            f"the bound is {max_ratio:g} x"
        )
        if check == "clip":
            verdicts.append(NormVerdict(region, norm, median, "clipped", bound / norm, reason))
        else:
            verdicts.append(NormVerdict(region, norm, median, "refused", 0.0, reason))
    return verdicts


def region_norm(region: str, pieces: Iterable[PieceLike], sizes: Mapping[str, int]) -> float:
    """The L2 norm of a region's delta over every element (each covered exactly once)."""
    spans: dict[str, list[tuple[int, int]]] = {name: [] for name in sizes}
    total = 0.0
    for piece in pieces:
        name, offset, count, values = check_piece(region, piece, sizes)
        spans[name].append((offset, count))
        total += float(values.double().square().sum())
    for name, covered in spans.items():
        check_coverage(region, name, sizes[name], covered)
    return math.sqrt(total)


def coordinate_statistic(stack: Tensor, rule: AggregationRule, trim_fraction: float) -> Tensor:
    """The median or trimmed mean over dim 0 of ``stack`` (regions x elements)."""
    count = stack.shape[0]
    ordered = torch.sort(stack, dim=0).values
    if rule == "median":
        middle = count // 2
        if count % 2:
            return ordered[middle].clone()
        return (ordered[middle - 1] + ordered[middle]) / 2
    if rule == "trimmed_mean":
        cut = math.floor(trim_fraction * count)
        kept = ordered[cut : count - cut]
        total = kept[0].clone()
        for row in kept[1:]:
            total.add_(row)
        return total / kept.shape[0]
    raise AggregationError(f"rule {rule!r} is not coordinate-wise")


@dataclass(frozen=True, slots=True)
class ScaledPiece:
    """A piece whose values were multiplied by a region's clipping scale."""

    name: str
    offset: int
    count: int
    values: Tensor


def _scaled(pieces: Iterable[PieceLike], scale: float) -> Iterator[PieceLike]:
    if scale == 1.0:
        yield from pieces
        return
    for piece in pieces:
        yield ScaledPiece(piece.name, piece.offset, piece.count, piece.values * scale)


class _Cursor:
    """One region's stream, consumed element range by element range."""

    def __init__(self, region: str, pieces: Iterable[PieceLike], sizes: Mapping[str, int]) -> None:
        self.region = region
        self._pieces = iter(pieces)
        self._sizes = sizes
        self.spans: dict[str, list[tuple[int, int]]] = {name: [] for name in sizes}
        self.name = ""
        self.offset = 0
        self._values = torch.empty(0)

    def ready(self) -> bool:
        """Hold a non-empty run of values; False once the stream has ended."""
        while self._values.numel() == 0:
            piece = next(self._pieces, None)
            if piece is None:
                return False
            name, offset, count, values = check_piece(self.region, piece, self._sizes)
            self.spans[name].append((offset, count))
            self.name, self.offset, self._values = name, offset, values
        return True

    @property
    def held(self) -> int:
        return self._values.numel()

    def take(self, count: int) -> Tensor:
        taken = self._values[:count]
        self._values = self._values[count:]
        self.offset += count
        return taken


def lockstep(
    specs: Mapping[str, tuple[int, ...]],
    sources: Mapping[str, Iterable[PieceLike]],
    statistic: Callable[[Tensor], Tensor],
) -> dict[str, Tensor]:
    """``statistic`` of the regions' deltas, element range by element range.

    Streams may cut their chunks differently; they must list the same tensors in the
    same order, each from its first element to its last, as the encoder writes them.
    """
    if not sources:
        raise AggregationError("no region to aggregate")
    sizes = {name: math.prod(shape) for name, shape in specs.items()}
    result = {name: torch.empty(size, dtype=torch.float32) for name, size in sizes.items()}
    cursors = [_Cursor(region, sources[region], sizes) for region in sorted(sources)]
    while True:
        live = [cursor.ready() for cursor in cursors]
        if not any(live):
            break
        if not all(live):
            ended = [c.region for c, ok in zip(cursors, live, strict=True) if not ok]
            raise AggregationError(f"regions {ended} ended before the others")
        lead = cursors[0]
        for cursor in cursors[1:]:
            if (cursor.name, cursor.offset) != (lead.name, lead.offset):
                raise AggregationError(
                    f"region {cursor.region!r} is at {cursor.name!r}[{cursor.offset}] where "
                    f"{lead.region!r} is at {lead.name!r}[{lead.offset}]: streams out of order"
                )
        name, offset = lead.name, lead.offset
        count = min(cursor.held for cursor in cursors)
        stack = torch.stack([cursor.take(count) for cursor in cursors])
        result[name][offset : offset + count] = statistic(stack)
    for cursor in cursors:
        for name, covered in cursor.spans.items():
            check_coverage(cursor.region, name, sizes[name], covered)
    return {name: result[name].reshape(shape) for name, shape in specs.items()}


@dataclass(frozen=True)
class Combined:
    """A round's combined delta and the norm check's verdict on every region."""

    delta: dict[str, Tensor]
    verdicts: tuple[NormVerdict, ...]

    @property
    def flagged(self) -> tuple[NormVerdict, ...]:
        """Verdicts that changed something (clipped or refused)."""
        return tuple(v for v in self.verdicts if v.action != "kept")


def combine(
    specs: Mapping[str, tuple[int, ...]],
    sources: Mapping[str, tuple[float, PieceSource]],
    config: AggregationConfig,
    order: Sequence[str] | None = None,
) -> Combined:
    """The round's delta under ``config`` from ``sources`` (region -> (tokens, pieces)).

    ``order`` is the order ``mean`` sums the regions in (default: sorted names); the
    coordinate-wise rules do not depend on it.
    """
    if not sources:
        raise AggregationError("no region to aggregate")
    if config.norm_check == "off":
        verdicts = judge_norms(dict.fromkeys(sources, 0.0), "off", config.max_norm_ratio)
    else:
        sizes = {name: math.prod(shape) for name, shape in specs.items()}
        norms = {
            region: region_norm(region, source(), sizes) for region, (_, source) in sources.items()
        }
        verdicts = judge_norms(norms, config.norm_check, config.max_norm_ratio)
    scales = {v.region: v.scale for v in verdicts if v.action != "refused"}
    if config.rule == "mean":
        delta = aggregate(
            specs,
            {
                region: (sources[region][0], _bind(sources[region][1], scale))
                for region, scale in scales.items()
            },
            None if order is None else [region for region in order if region in scales],
        )
    else:
        rule, trim = config.rule, config.trim_fraction
        delta = lockstep(
            specs,
            {region: _scaled(sources[region][1](), scale) for region, scale in scales.items()},
            lambda stack: coordinate_statistic(stack, rule, trim),
        )
    return Combined(delta, tuple(verdicts))


def folded(delta: dict[str, Tensor], regions: Iterable[str], config: AggregationConfig) -> Combined:
    """A mean already folded as deltas arrived, as :func:`combine` would report it.

    Only a job whose rule is ``mean`` without a norm check folds deltas on arrival
    (:func:`folds_on_arrival`): every region is then kept, unscaled.
    """
    if not folds_on_arrival(config):
        raise AggregationError(
            f"rule {config.rule!r} with norm_check {config.norm_check!r} "
            "cannot be folded as deltas arrive"
        )
    verdicts = judge_norms(dict.fromkeys(regions, 0.0), "off", config.max_norm_ratio)
    return Combined(delta, tuple(verdicts))


def folds_on_arrival(config: AggregationConfig) -> bool:
    """Whether a round's deltas can be summed as they are accepted, each decoded once.

    The norm check compares every delta with the round's median, known only at quorum,
    and the coordinate-wise rules need all regions' values at once.
    """
    return config.rule == "mean" and config.norm_check == "off"


def _bind(source: PieceSource, scale: float) -> PieceSource:
    if scale == 1.0:
        return source
    return lambda: _scaled(source(), scale)
