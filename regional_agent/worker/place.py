"""Where a rank is: its group's hand-off directory, its rank and the group's size, the
control group its decisions travel on, and its device."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from regional_agent.handoff.directory import HandoffDir


@dataclass(frozen=True)
class RankPlace:
    """Where this rank is: its group's hand-off directory, rank, size, control group
    (None: the default group) and device."""

    handoff: HandoffDir
    rank: int
    world_size: int
    control: dist.ProcessGroup | None
    device: torch.device
