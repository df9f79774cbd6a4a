"""How many ranks a region's worker group runs: a pure decision with its reason.

``workers.count: auto`` runs one rank per visible GPU on NCCL (NCCL refuses two ranks on
one GPU, and one rank per GPU is what saturates it) and :data:`GLOO_AUTO_RANKS` ranks on
gloo, so a CPU box still exercises a real process group. An explicit count is kept when
the backend can run it.

Which GPUs the workers see is ``CUDA_VISIBLE_DEVICES`` of their environment when it is
set there (a region's share of a shared host), else every GPU of the machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

AUTO: Literal["auto"] = "auto"
GLOO_AUTO_RANKS = 2
VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"


class RankCountError(ValueError):
    """The requested rank count cannot run on the backend and the GPUs visible."""


@dataclass(frozen=True, slots=True)
class RankChoice:
    """The ranks a worker group runs, and why."""

    count: int
    reason: str


def choose_ranks(requested: int | Literal["auto"], backend: str, visible_gpus: int) -> RankChoice:
    """Decide the group's rank count; raise :class:`RankCountError` if it cannot run."""
    if backend == "nccl":
        if requested == AUTO:
            if visible_gpus < 1:
                raise RankCountError(
                    "backend nccl needs a GPU, but none is visible to the workers "
                    "(use backend gloo or auto on a machine without GPUs)"
                )
            return RankChoice(
                visible_gpus, f"count auto: one nccl rank per visible GPU ({visible_gpus})"
            )
        if requested > visible_gpus:
            raise RankCountError(
                f"nproc_per_node {requested} exceeds the {visible_gpus} visible GPUs: NCCL "
                "refuses two ranks on one GPU (a single-GPU machine runs world size 1)"
            )
        return RankChoice(
            requested, f"count {requested}: nccl ranks on {visible_gpus} visible GPUs"
        )
    if requested == AUTO:
        return RankChoice(GLOO_AUTO_RANKS, f"count auto: {GLOO_AUTO_RANKS} {backend} ranks")
    return RankChoice(requested, f"count {requested}: {backend} ranks as configured")


def parse_visible_devices(value: str) -> tuple[str, ...]:
    """The devices a ``CUDA_VISIBLE_DEVICES`` value names, in order.

    Like CUDA, the list ends at the first entry that is neither a non-negative index nor
    a ``GPU-``/``MIG-`` UUID (so ``""`` and ``"-1"`` name none).
    """
    devices: list[str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        devices.append(entry)
    return tuple(devices)


def visible_gpu_count(
    workers_env: Mapping[str, str], own_env: Mapping[str, str], device_count: int
) -> int:
    """GPUs the workers will see; ``device_count`` is what this process's torch sees.

    When the workers' environment narrows ``CUDA_VISIBLE_DEVICES`` differently from this
    process's, its entries count, capped by ``device_count`` where this process sees them
    all.
    """
    value = workers_env.get(VISIBLE_DEVICES_ENV)
    own = own_env.get(VISIBLE_DEVICES_ENV)
    if value is None or value == own:
        return device_count
    named = len(parse_visible_devices(value))
    return named if own is not None else min(named, device_count)
