"""Streaming weighted averaging of decoded region deltas.

:class:`WeightedSum` folds each region's decoded pieces (named flat slices of tensors)
into one fp32 running sum, so memory stays O(model) whatever the number of regions:
the sum (1x model) plus one reusable scratch copy (1x) that makes a region's
contribution all-or-nothing; :meth:`WeightedSum.mean` frees the scratch before it
allocates its result, so the peak stays at 2x model size.

:func:`aggregate` decodes several regions at once on a thread pool (sha256, zstd and
torch release the GIL) while it folds them, one at a time and in order, into the sum. Each
region decoded at once holds a staged copy instead of the scratch, so its peak is
``1 + ahead`` x model, ``ahead`` bounded by the CPUs and the free memory
(:func:`regions_at_once`; 1 keeps the 2x of :meth:`WeightedSum.add_region`).

fp32 accumulation suffices: a region's decoded delta carries int8/int4 quantization
error of at least 2^-8 of its block's range, while summing R regions in fp32 adds about
R x 2^-24 relative error.

Determinism: floating-point addition is not associative, so the result depends on the
order regions are added, and on nothing else (each element is written exactly once per
region, so the order of pieces within a region does not matter; the arithmetic uses only
correctly rounded multiplies, adds and divides, so neither threads nor the CPU's SIMD
width change a bit). :func:`aggregate` adds in sorted region names unless given an
``order``. The coordinator folds deltas in as they are accepted
(:mod:`coordinator.aggregation.accumulator`, decoding each verified upload again piece by
piece, :meth:`WeightedSum.add_verified`) and records that arrival order
durably with the round, which it passes as ``order`` when it re-aggregates from its
spool instead (after a restart): the same bits either way.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final, Literal, Protocol

import torch
from torch import Tensor

from coordinator.executors import side_by_side
from coordinator.rounds.late import validate_key
from geofed.codec.host_threads import one_thread, usable_cpus

# The delta arithmetic lives in geofed.deltas, shared with the regional agents; it is
# re-exported here for the coordinator's callers.
from geofed.deltas import (
    all_finite,
    apply_update,
    feedback_residual,
    pseudo_gradient,
    update_to_publish,
)
from geofed.types import InvalidName

__all__ = [
    "AggregationError",
    "DeltaStager",
    "Feed",
    "PieceLike",
    "StagedDelta",
    "WeightedSum",
    "aggregate",
    "all_finite",
    "apply_update",
    "check_coverage",
    "check_piece",
    "feedback_residual",
    "pseudo_gradient",
    "regions_at_once",
    "update_to_publish",
]


#: Calls its argument with each piece of one delta, each element once, possibly from
#: several threads at once (:meth:`WeightedSum.add_verified`).
Feed = Callable[[Callable[["PieceLike"], None]], None]


class AggregationError(ValueError):
    """A region's pieces or a tensor set is unusable; the running sum is unchanged."""


class PieceLike(Protocol):
    """A decoded slice of one tensor: ``values`` fills flat elements [offset, offset+count)."""

    @property
    def name(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def values(self) -> Tensor: ...


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class WeightedSum:
    """Running sum of ``weight x delta`` over regions, fp32, with all-or-nothing regions."""

    def __init__(self, specs: Mapping[str, tuple[int, ...]]) -> None:
        if not specs:
            raise AggregationError("no tensors to aggregate: specs is empty")
        self._shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in specs.items():
            if not isinstance(name, str) or not name:
                raise AggregationError(f"tensor name must be a non-empty string, got {name!r}")
            dims = tuple(shape)
            if not all(_is_int(d) and d >= 0 for d in dims):
                raise AggregationError(f"tensor {name!r} has an invalid shape {shape!r}")
            self._shapes[name] = dims
        self._sum = {
            n: torch.zeros(math.prod(s), dtype=torch.float32) for n, s in self._shapes.items()
        }
        self._scratch: dict[str, Tensor] | None = None
        self._weights: dict[str, float] = {}

    @property
    def regions(self) -> tuple[str, ...]:
        """Regions added so far, in the order they were added."""
        return tuple(self._weights)

    @property
    def weights(self) -> Mapping[str, float]:
        """Each added region's weight."""
        return dict(self._weights)

    @property
    def total_weight(self) -> float:
        return sum(self._weights.values())

    @property
    def nbytes(self) -> int:
        """Bytes held now: the sum plus the scratch buffer while it exists."""
        held = sum(t.numel() for t in self._sum.values())
        if self._scratch is not None:
            held += sum(t.numel() for t in self._scratch.values())
        return 4 * held

    def add_region(self, region: str, weight: float, pieces: Iterable[PieceLike]) -> None:
        """Add ``weight x`` the region's delta; every element must be covered exactly once.

        Pieces are copied into a scratch buffer as they stream in, and folded into the
        sum only once the region is known to be complete, so any error (bad piece,
        gap, overlap, or an exception from the iterator itself) leaves the sum as it was.
        """
        factor = self._check_addition(region, weight)
        if self._scratch is None:
            self._scratch = {n: torch.empty_like(t) for n, t in self._sum.items()}
        stager = DeltaStager(region, self._shapes, buffers=self._scratch)
        for piece in pieces:
            stager.add(piece)
        self._fold(region, factor, stager.finish())

    def add_staged(self, region: str, weight: float, staged: StagedDelta) -> None:
        """Add ``weight x`` a delta decoded and checked earlier (:class:`DeltaStager`).

        The same arithmetic as :meth:`add_region`, so a region added either way moves
        the sum by the same bits. ``staged`` is consumed: its buffers are scaled in place.
        """
        factor = self._check_addition(region, weight)
        if staged.region != region:
            raise AggregationError(f"staged delta of {staged.region!r} offered as {region!r}")
        if {n: t.numel() for n, t in staged.values.items()} != {
            n: t.numel() for n, t in self._sum.items()
        }:
            raise AggregationError(f"region {region!r}: staged tensors differ from the sum's")
        self._fold(region, factor, staged)

    def add_verified(self, region: str, weight: float, feed: Feed) -> None:
        """Add ``weight x`` a delta whose stream was verified whole before (its upload: every
        value finite, every element once), each piece folded where it falls as ``feed``
        decodes it again (on several threads at once: :func:`geofed.codec.stored.decode_stored`):
        no copy of the delta is ever held. The same arithmetic
        as :meth:`add_staged`, element by element, so the same bits. Each piece is checked
        again; a failure part way (the stored stream no longer decodes, or decodes to
        something else) leaves the sum part-added, so the caller discards it
        (:class:`~coordinator.aggregation.accumulator.RoundAccumulator` does).
        """
        factor = self._check_addition(region, weight)
        sizes = {name: tensor.numel() for name, tensor in self._sum.items()}
        covered = dict.fromkeys(sizes, 0)
        lock = threading.Lock()

        def fold(piece: PieceLike) -> None:
            name, offset, count, values = check_piece(region, piece, sizes)
            # mul then add, each correctly rounded, as _fold_part does; pieces are disjoint.
            self._sum[name][offset : offset + count].add_(values.mul_(factor))
            with lock:
                covered[name] += count

        with one_thread():
            feed(fold)
        short = sorted(name for name, count in covered.items() if count != sizes[name])
        if short:
            raise AggregationError(
                f"region {region!r}: the delta covers {short[:5]} with other than their elements"
            )
        self._weights[region] = factor

    def _check_addition(self, region: str, weight: float) -> float:
        try:
            validate_key(region)
        except InvalidName as exc:
            raise AggregationError(str(exc)) from None
        if region in self._weights:
            raise AggregationError(f"region {region!r} was already added")
        if isinstance(weight, bool) or not (isinstance(weight, int | float) and weight > 0):
            raise AggregationError(f"region {region!r}: weight must be > 0, got {weight!r}")
        if weight == float("inf"):
            raise AggregationError(f"region {region!r}: weight must be finite, got {weight!r}")
        return float(weight)

    def _fold(self, region: str, factor: float, staged: StagedDelta) -> None:
        # Parts of about FOLD_PART elements fold on every usable CPU, each on one thread:
        # the same elementwise ops whatever the split, so the same bits.
        parts = _fold_parts(self._sum, staged.values)
        side_by_side([functools.partial(_fold_part, part, factor) for part in parts])
        self._weights[region] = factor

    def take_mean(self) -> dict[str, Tensor]:
        """:meth:`mean`, made in the running sum's own tensors (which it then releases):
        no memory beyond the sum's. The sum is unusable afterwards.
        """
        total = self._averaging()
        # In the sum's own tensors: the same bits as mean()'s new ones, no second copy.
        result = {n: self._sum[n].div_(total).reshape(s) for n, s in self._shapes.items()}
        self._sum = {}
        return result

    def mean(self) -> dict[str, Tensor]:
        """Return ``sum / total weight`` as new tensors in their declared shapes."""
        total = self._averaging()
        return {n: self._sum[n].div(total).reshape(s) for n, s in self._shapes.items()}

    def _averaging(self) -> float:
        """The total weight to divide by, the scratch buffer released first (it is not
        needed once the sum is final); :class:`AggregationError` before any region."""
        if not self._weights:
            raise AggregationError("no region was added; there is nothing to average")
        self._scratch = None
        return self.total_weight


#: Elements of one fold job (4 MiB of the sum and as much of the delta).
FOLD_PART = 1 << 20

_Part = list[tuple[Tensor, Tensor]]


def _fold_parts(
    sums: Mapping[str, Tensor], values: Mapping[str, Tensor], part_elements: int = FOLD_PART
) -> list[_Part]:
    """(sum slice, delta slice) pairs cut and packed into jobs of about ``part_elements``."""
    parts: list[_Part] = [[]]
    size = 0
    for name, total in sums.items():
        for start in range(0, total.numel(), part_elements):
            stop = min(start + part_elements, total.numel())
            if size and size + stop - start > part_elements:
                parts.append([])
                size = 0
            parts[-1].append((total[start:stop], values[name][start:stop]))
            size += stop - start
    return parts


def _fold_part(part: _Part, factor: float) -> None:
    """``total += delta * factor`` for each pair of ``part``, on the calling thread alone."""
    with one_thread():
        for total, delta in part:
            # mul then add, each correctly rounded: no fused multiply-add whose use would
            # depend on the CPU the coordinator restarts on.
            total.add_(delta.mul_(factor))


@dataclass(frozen=True, slots=True)
class StagedDelta:
    """One region's whole delta, decoded and checked, as flat fp32 tensors by name."""

    region: str
    values: dict[str, Tensor]


class DeltaStager:
    """Copies one region's decoded pieces into dense buffers, checking each one.

    :meth:`finish` checks that every element was covered exactly once and returns the
    :class:`StagedDelta`; until then nothing outside the stager has seen a value.
    """

    def __init__(
        self,
        region: str,
        shapes: Mapping[str, tuple[int, ...]],
        *,
        buffers: dict[str, Tensor] | None = None,
    ) -> None:
        try:
            validate_key(region)
        except InvalidName as exc:
            raise AggregationError(str(exc)) from None
        self._region = region
        if buffers is None:
            buffers = {
                name: torch.empty(math.prod(shape), dtype=torch.float32)
                for name, shape in shapes.items()
            }
        self._buffers = buffers
        self._sizes = {name: tensor.numel() for name, tensor in buffers.items()}
        self._spans: dict[str, list[tuple[int, int]]] = {name: [] for name in buffers}

    def add(self, piece: PieceLike) -> None:
        """Copy one checked piece into place (:func:`check_piece`).

        On the calling thread alone, like the decoding that made the piece: regions are
        staged side by side on their own threads (:func:`aggregate`).
        """
        with one_thread():
            name, offset, count, values = check_piece(self._region, piece, self._sizes)
            self._buffers[name][offset : offset + count].copy_(values)
        self._spans[name].append((offset, count))

    def finish(self) -> StagedDelta:
        """The staged delta; :class:`AggregationError` on a gap or an overlap."""
        for name, covered in self._spans.items():
            check_coverage(self._region, name, self._sizes[name], covered)
        return StagedDelta(self._region, self._buffers)


def check_piece(
    region: str, piece: PieceLike, sizes: Mapping[str, int]
) -> tuple[str, int, int, Tensor]:
    """A region's piece, checked against the tensors' element counts ``sizes`` and its
    values for NaN and Inf."""
    name, offset, count, values = piece.name, piece.offset, piece.count, piece.values
    where = f"region {region!r}, tensor {name!r}"
    if name not in sizes:
        raise AggregationError(f"region {region!r}: unknown tensor {name!r}")
    size = sizes[name]
    if not (_is_int(offset) and _is_int(count)):
        raise AggregationError(
            f"{where}: offset and count must be integers, got {offset!r} and {count!r}"
        )
    if offset < 0 or count <= 0 or offset + count > size:
        raise AggregationError(
            f"{where}: slice [{offset}, {offset + count}) is outside its {size} elements"
        )
    if not isinstance(values, Tensor) or values.dtype != torch.float32:
        kind = values.dtype if isinstance(values, Tensor) else type(values).__name__
        raise AggregationError(f"{where}: values must be a float32 tensor, not {kind}")
    if values.dim() != 1 or values.numel() != count:
        raise AggregationError(
            f"{where}: values have shape {tuple(values.shape)}, expected ({count},)"
        )
    if not all_finite(values):
        raise AggregationError(f"{where}: slice [{offset}, {offset + count}) contains NaN or Inf")
    return name, offset, count, values


def check_coverage(region: str, name: str, size: int, spans: list[tuple[int, int]]) -> None:
    """Raise unless ``spans`` (offset, count) cover ``size`` elements exactly once."""
    where = f"region {region!r}, tensor {name!r}"
    position = 0
    for offset, count in sorted(spans):
        if offset > position:
            raise AggregationError(f"{where}: elements [{position}, {offset}) are missing (gap)")
        if offset < position:
            raise AggregationError(
                f"{where}: elements [{offset}, {min(position, offset + count)}) are covered "
                "more than once (overlap)"
            )
        position = offset + count
    if position < size:
        raise AggregationError(f"{where}: elements [{position}, {size}) are missing (gap)")


PieceSource = Callable[[], Iterable[PieceLike]]

#: The share of the free memory that regions decoded ahead may take.
AHEAD_MEMORY_SHARE = 0.5


def aggregate(
    specs: Mapping[str, tuple[int, ...]],
    sources: Mapping[str, tuple[float, PieceSource]],
    order: Sequence[str] | None = None,
    *,
    workers: int | None = None,
) -> dict[str, Tensor]:
    """Return the weighted mean of ``sources`` (region -> (weight, piece source)).

    Regions are added in sorted name order unless ``order`` (a permutation of the
    sources, e.g. the recorded arrival order) is given. Each source is called once. Up
    to ``workers`` regions (by default :func:`regions_at_once`) are decoded and staged at
    once on a thread pool, and each is folded into the sum in its turn, so the result is
    the same bits whatever ``workers`` is; with 1, each source is called when its turn
    comes, on the calling thread.
    """
    sequence = sorted(sources) if order is None else list(order)
    if sorted(sequence) != sorted(sources):
        raise AggregationError(
            f"order {sequence} is not a permutation of the sources {sorted(sources)}"
        )
    total = WeightedSum(specs)
    ahead = regions_at_once(len(sequence), total.nbytes) if workers is None else workers
    if ahead <= 1 or len(sequence) <= 1:
        for region in sequence:
            weight, source = sources[region]
            total.add_region(region, weight, source())
        return total.mean()
    shapes = {name: tuple(shape) for name, shape in specs.items()}
    spare: list[dict[str, Tensor]] = []  # staged buffers already folded, to reuse

    def stage(region: str, buffers: dict[str, Tensor] | None) -> StagedDelta:
        stager = DeltaStager(region, shapes, buffers=buffers)
        for piece in sources[region][1]():
            stager.add(piece)
        return stager.finish()

    pending: deque[tuple[str, Future[StagedDelta]]] = deque()
    upcoming = iter(sequence)
    pool = ThreadPoolExecutor(min(ahead, len(sequence)), thread_name_prefix="geofed-aggregate")
    try:
        for region in upcoming:
            pending.append((region, pool.submit(stage, region, None)))
            if len(pending) == ahead:
                break
        while pending:
            region, future = pending.popleft()
            staged = future.result()
            total.add_staged(region, sources[region][0], staged)
            spare.append(staged.values)
            following = next(upcoming, None)
            if following is not None:
                pending.append((following, pool.submit(stage, following, spare.pop())))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    spare.clear()
    return total.mean()


#: Regions decoded at once by default: with the running sum, 3 model-sized copies at most.
MAX_REGIONS_AT_ONCE: Final = 2


def regions_at_once(
    regions: int,
    model_bytes: int,
    *,
    cpus: int | None = None,
    available: int | Literal["measure"] | None = "measure",
) -> int:
    """How many regions :func:`aggregate` decodes at once by default: one per usable CPU,
    at most :data:`MAX_REGIONS_AT_ONCE` (the sum and the staged copies stay within 3x the
    model, whatever the number of regions), as long as their staged copies fit in
    :data:`AHEAD_MEMORY_SHARE` of the available memory. ``cpus`` and ``available`` (bytes,
    None: unknown) are this machine's unless given."""
    fit = regions
    memory = available_memory() if available == "measure" else available
    if memory is not None and model_bytes > 0:
        fit = int(memory * AHEAD_MEMORY_SHARE) // model_bytes
    cpu_count = usable_cpus() if cpus is None else cpus
    return max(1, min(regions, cpu_count, fit, MAX_REGIONS_AT_ONCE))


def available_memory() -> int | None:
    """Bytes of memory available without swapping (Linux ``MemAvailable``, which counts
    reclaimable page cache, else the free pages); None where neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
