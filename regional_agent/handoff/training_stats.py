"""What a worker group measured while training one round, as it reports it to the agent.

Times are the slowest rank's (the region steps at its pace), and each rank's own are
kept beside them (:class:`RankTiming`: a straggler inside the region shows there); memory
is the largest rank's. Figures that cannot be measured honestly are None rather than
zero: peak memory on the CPU, and the gradient-communication time under FSDP (see
:mod:`regional_agent.worker.comm_timer`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["RankTiming", "TrainingStats"]


@dataclass(frozen=True, slots=True)
class RankTiming:
    """One rank's own times in a round."""

    rank: int
    node: int
    """The node the rank ran on: an index, rank 0's node first (see ``host`` for its
    name)."""
    busy_seconds: float | None
    """Mean seconds a step it was not waiting for its peers, approximately: the step's
    wall time less the time it had a data-parallel collective in flight (DDP's gradient
    all-reduce, FSDP's all-gathers and reduce-scatters, and HSDP's all-reduce between
    replicas besides). The group steps together, so the
    wall time is every rank's; what a slow rank lacks is the waiting. An approximation:
    computation that overlaps a collective counts as waiting, and a wait outside those
    collectives (another one) as busy. None where the waiting is not measured
    (``comm_seconds``)."""
    data_wait_seconds: float
    """Time it waited for the task's batches, the round's total."""
    host: str = ""
    """The host name of the machine it ran on."""

    def __post_init__(self) -> None:
        for name in ("rank", "node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.busy_seconds is not None:
            _require_non_negative("busy_seconds", self.busy_seconds)
        if not isinstance(self.host, str):
            raise TypeError(f"host must be a string, got {self.host!r}")
        _require_non_negative("data_wait_seconds", self.data_wait_seconds)

    @classmethod
    def from_mapping(cls, data: object) -> RankTiming:
        if not isinstance(data, Mapping):
            raise TypeError(f"a rank's timing must be an object, got {data!r}")
        names = {f.name for f in fields(cls)}
        if set(data) != names:
            raise ValueError(f"a rank's timing has the fields {sorted(names)}, got {sorted(data)}")
        return cls(**data)


@dataclass(frozen=True, slots=True)
class TrainingStats:
    """One round's training measurements (the ``stats`` of a round summary)."""

    step_seconds: float
    """Mean wall time of one optimizer step, data and gradient sync included."""
    tokens_per_second: float
    """The region's tokens (all ranks) over the inner loop's wall time."""
    data_wait_seconds: float
    """Time spent waiting for the task's batches, the round's total."""
    learning_rate: float
    """The learning rate of the round's last step."""
    grad_norm: float
    """The gradient's global L2 norm at the round's last step, before any clipping.

    A norm that is not finite is +inf, NaN included: a summary must equal itself."""
    flops_per_token: float
    """The task's training FLOPs per token (:meth:`geofed.task.Task.flops_per_token`)."""
    comm_seconds: float | None = None
    """Wall time with a data-parallel collective in flight, the round's total (DDP, FSDP
    and HSDP, see :mod:`regional_agent.worker.comm_timer`; None where a collective's end
    could not be marked)."""
    peak_memory_bytes: int | None = None
    """Peak accelerator memory allocated during the round (CUDA only)."""
    accelerator: str | None = None
    """The device's name as torch reports it; None on the CPU."""
    ranks: tuple[RankTiming, ...] = ()
    """Each rank's own times, by rank (empty from workers that did not report them)."""

    def __post_init__(self) -> None:
        for name in ("step_seconds", "tokens_per_second", "data_wait_seconds", "flops_per_token"):
            _require_non_negative(name, getattr(self, name))
        _require_non_negative("learning_rate", self.learning_rate)
        # A diverging step's norm is reported, as +inf.
        _require_number("grad_norm", self.grad_norm)
        if math.isnan(self.grad_norm):
            raise ValueError("grad_norm must not be NaN (a non-finite norm is reported as inf)")
        if self.comm_seconds is not None:
            _require_non_negative("comm_seconds", self.comm_seconds)
        peak = self.peak_memory_bytes
        if peak is not None and (isinstance(peak, bool) or not isinstance(peak, int) or peak < 0):
            raise ValueError(f"peak_memory_bytes must be an integer >= 0, got {peak!r}")
        if self.accelerator is not None and not isinstance(self.accelerator, str):
            raise ValueError(f"accelerator must be a string, got {self.accelerator!r}")
        if [timing.rank for timing in self.ranks] != list(range(len(self.ranks))):
            raise ValueError("ranks must hold one timing per rank, in rank order from 0")

    @classmethod
    def from_mapping(cls, data: object) -> TrainingStats:
        """Read the ``stats`` object of a done marker.

        :class:`ValueError` or :class:`TypeError` says what is wrong.
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"stats must be an object, got {data!r}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"stats: unknown fields {unknown}")
        values: dict[str, Any] = dict(data)
        ranks = values.get("ranks", ())
        if not isinstance(ranks, list | tuple):
            raise TypeError(f"stats: ranks must be a list, got {ranks!r}")
        values["ranks"] = tuple(RankTiming.from_mapping(timing) for timing in ranks)
        try:
            return cls(**values)
        except TypeError as exc:
            raise TypeError(f"stats: {exc}") from None


def _require_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {value!r}")


def _require_non_negative(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
