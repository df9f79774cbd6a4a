"""The error-feedback residual, sharded over a worker group.

Each rank keeps a contiguous slice of every tensor's flattened values on its device
(:func:`span`: rank r of W holds elements [r·⌈n/W⌉, (r+1)·⌈n/W⌉)), whatever the model's
parallelism, so the residual costs 4/W bytes per parameter on every rank. When rank 0
quantizes a tensor it gathers that tensor's residual whole (:meth:`ResidualGroup.gather`)
and scatters the new one back (:meth:`ResidualGroup.scatter`): no rank ever holds more
than one whole tensor of it. A group of one rank (or one without torch.distributed) keeps
the whole and sends nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def span(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """The elements [begin, end) of a tensor of ``numel`` elements that ``rank`` keeps."""
    block = math.ceil(numel / world_size) if world_size > 0 else numel
    begin = min(rank * block, numel)
    return begin, min(begin + block, numel)


@dataclass(frozen=True, slots=True)
class DeviceResidual:
    """The residual a job's last quantized delta left, this rank's slices of it on its
    device (:func:`span` of each tensor's flattened values), ``shapes`` the whole tensors';
    ``written``: its tensors are in a file (the round's, or the job's held one)."""

    job: str
    round: int
    id: str
    slices: dict[str, torch.Tensor]
    shapes: dict[str, tuple[int, ...]]
    written: bool


class ResidualGroup:
    """The ranks that share a residual: gathers and scatters its tensors (collectives of
    the default group, on the ranks' device) and broadcasts rank 0's decisions about it
    (on ``control``, the group decisions travel on; None: the default group)."""

    def __init__(
        self, rank: int, world_size: int, device: torch.device, control: Any = None
    ) -> None:
        self.rank, self.world_size, self.device, self._control = rank, world_size, device, control

    @property
    def alone(self) -> bool:
        return self.world_size == 1

    def gather(self, mine: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Rank 0: the whole tensor of ``shape`` from every rank's slice (``mine`` this
        rank's); the other ranks: None. A collective."""
        numel = math.prod(shape)
        if self.alone:
            return mine.reshape(shape)
        block = math.ceil(numel / self.world_size)
        if block == 0:
            return torch.zeros(shape, device=self.device) if self.rank == 0 else None
        sent = mine
        if mine.numel() != block:  # the last ranks' slices are short: padded to the block
            sent = torch.zeros(block, device=self.device)
            sent[: mine.numel()] = mine
        if self.rank != 0:
            dist.gather(sent, None, dst=0)
            return None
        whole = torch.empty(block * self.world_size, device=self.device)
        dist.gather(sent, list(whole.view(self.world_size, block).unbind(0)), dst=0)
        return whole[:numel].view(shape)

    def scatter(
        self, whole: torch.Tensor | None, shape: tuple[int, ...], into: torch.Tensor | None
    ) -> torch.Tensor:
        """Each rank's slice of rank 0's ``whole`` (of ``shape``; None on rank 0: zeros),
        copied into ``into`` when given (this rank's slice of the same tensor), else new.
        A collective."""
        numel = math.prod(shape)
        begin, end = span(numel, self.rank, self.world_size)
        if self.rank == 0 and whole is None:
            whole = torch.zeros(shape, device=self.device)
        if numel == 0:
            mine = torch.zeros(0, device=self.device)
        elif self.alone:
            assert whole is not None
            mine = whole.detach().reshape(-1)[begin:end].to(self.device, torch.float32)
        else:
            block = math.ceil(numel / self.world_size)
            received = torch.empty(block, device=self.device)
            parts = None
            if self.rank == 0:
                assert whole is not None
                flat = whole.detach().reshape(-1).to(self.device, torch.float32)
                if flat.numel() != block * self.world_size:
                    padded = torch.zeros(block * self.world_size, device=self.device)
                    padded[:numel] = flat
                    flat = padded
                parts = list(flat.view(self.world_size, block).unbind(0))
            dist.scatter(received, parts, src=0)
            mine = received[: end - begin]
        if into is not None:
            into.copy_(mine)
            return into
        return mine

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a collective on the control group)."""
        if self.alone:
            return value
        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return box[0]
