"""Where the demo's regions train: a pure decision from the visible GPUs, with its reason.

No GPU: every region runs 2 gloo ranks on the CPU, as a real deployment's CI does, or as
many as asked (``geofed demo --workers N``: one rank a region on a small machine). Fewer
GPUs than regions (a workstation with one): the regions share them round-robin, one NCCL
rank each, since NCCL refuses two ranks of one group on one GPU. At least as many GPUs
as regions: the GPUs are split into contiguous shares (sizes differing by at most one)
and each region runs one NCCL rank per GPU of its share. Each agent gets its share as
``CUDA_VISIBLE_DEVICES`` in ``workers.env`` and ``workers.count: auto``, so its own
launcher arrives at the same rank count (:func:`regional_agent.launch.ranks.choose_ranks`);
a count asked for is written as is.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from regional_agent.launch.ranks import (
    AUTO,
    VISIBLE_DEVICES_ENV,
    choose_ranks,
    parse_visible_devices,
)


@dataclass(frozen=True, slots=True)
class RegionPlacement:
    """One region's share of the machine."""

    region: str
    devices: tuple[str, ...]
    """``CUDA_VISIBLE_DEVICES`` entries of its workers; empty on the CPU."""
    backend: str
    ranks: int


@dataclass(frozen=True, slots=True)
class Placement:
    """Every region's share, and why."""

    regions: tuple[RegionPlacement, ...]
    reason: str
    asked_ranks: int | None = None
    """Each region's rank count as asked (a CPU run); None: the launcher's ``auto``."""

    def of(self, region: str) -> RegionPlacement:
        for share in self.regions:
            if share.region == region:
                return share
        raise KeyError(region)

    def describe(self) -> str:
        """One line: the reason, then each region's GPUs (if any)."""
        shares = [f"{s.region} GPU {','.join(s.devices)}" for s in self.regions if s.devices]
        return self.reason + (f" ({'; '.join(shares)})" if shares else "")

    def agents_line(self) -> str:
        """How many agents run how many workers, e.g. ``3 regional agents, 2 local workers
        each (gloo)``."""
        ranks = [share.ranks for share in self.regions]
        backends = sorted({share.backend for share in self.regions})
        agents = f"{len(ranks)} regional agent{'s' if len(ranks) != 1 else ''}"
        if len(set(ranks)) == 1:
            workers = f"{ranks[0]} local worker{'s' if ranks[0] != 1 else ''} each"
        else:
            workers = f"{'/'.join(map(str, ranks))} local workers"
        return f"{agents}, {workers} ({', '.join(backends)})"


class PlacementRefused(ValueError):
    """The regions cannot be placed as asked."""


def place(
    devices: Sequence[str], regions: Sequence[str], cpu_ranks: int | None = None
) -> Placement:
    """Decide each region's devices, backend and ranks from the GPUs ``devices`` visible.

    ``cpu_ranks``: each region's gloo ranks when no GPU is visible (default: the
    launcher's ``auto``); refused with a GPU, where a region runs a rank per GPU.
    """
    if not regions:
        raise PlacementRefused("no regions to place")
    gpus, count = len(devices), len(regions)
    shares: list[tuple[str, tuple[str, ...]]] = []
    if gpus == 0:
        ranks = choose_ranks(AUTO, "gloo", 0).count if cpu_ranks is None else cpu_ranks
        if ranks < 1:
            raise PlacementRefused(f"a region needs at least 1 worker, not {ranks}")
        shares = [(region, ()) for region in regions]
        plural = "s" if ranks != 1 else ""
        reason = f"no GPU visible: {ranks} gloo rank{plural} per region on the CPU"
        return Placement(_shares(shares, "gloo", ranks), reason, cpu_ranks)
    if cpu_ranks is not None:
        raise PlacementRefused(
            f"{_gpus(gpus)} visible: each region runs one nccl rank per GPU of its share; "
            "a worker count is for CPU runs only"
        )
    if gpus < count:
        shares = [(region, (devices[i % gpus],)) for i, region in enumerate(regions)]
        sharing = "share it" if gpus == 1 else "share them in turn"
        reason = f"{_gpus(gpus)} for {count} regions: the regions {sharing}, one nccl rank each"
        return Placement(_shares(shares, "nccl"), reason)
    size, extra = divmod(gpus, count)
    start = 0
    for i, region in enumerate(regions):
        end = start + size + (1 if i < extra else 0)
        shares.append((region, tuple(devices[start:end])))
        start = end
    if count == 1:
        reason = f"{_gpus(gpus)} for 1 region: one nccl rank per GPU"
    else:
        split = "+".join(str(len(share)) for _, share in shares)
        reason = f"{_gpus(gpus)} for {count} regions: split {split}, one nccl rank per GPU"
    return Placement(_shares(shares, "nccl"), reason)


def _shares(
    shares: Sequence[tuple[str, tuple[str, ...]]], backend: str, ranks: int | None = None
) -> tuple[RegionPlacement, ...]:
    return tuple(
        RegionPlacement(
            region,
            devices,
            backend,
            ranks if ranks is not None else choose_ranks(AUTO, backend, len(devices)).count,
        )
        for region, devices in shares
    )


def _gpus(n: int) -> str:
    return f"{n} GPU{'s' if n != 1 else ''}"


def visible_devices() -> tuple[str, ...]:
    """The GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` entries for its children."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    inherited = os.environ.get(VISIBLE_DEVICES_ENV)
    if inherited is not None:
        # Children get the same physical devices this process was given.
        return parse_visible_devices(inherited)[:count]
    return tuple(str(index) for index in range(count))
