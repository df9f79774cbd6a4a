"""How the coordinator turns the averaged pseudo-gradient into new parameters: the outer
optimizer's configuration, apart from its math (:mod:`geofed.outer_step`) so that what
only reads job specs and control messages (the CLI among them) does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["OuterOptimizerConfig"]


class OuterOptimizerConfig(BaseModel):
    """How the coordinator turns the averaged pseudo-gradient into new parameters."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["nesterov", "average"] = Field(
        default="nesterov",
        description="'nesterov': SGD with Nesterov momentum (DiLoCo); 'average': θ' = θ - Δ.",
    )
    lr: float = Field(default=0.3, gt=0, allow_inf_nan=False, description="Outer learning rate.")
    momentum: float = Field(
        default=0.8, ge=0, lt=1, allow_inf_nan=False, description="Nesterov momentum μ."
    )
    momentum_warmup_rounds: int = Field(
        default=4,
        ge=0,
        le=1_000_000,
        description="Rounds k over which μ ramps linearly from 0 at the first outer step "
        "to its value at step k+1 (no effect at μ = 0).",
    )

    def momentum_at(self, step: int) -> float:
        """The momentum of the outer step taken after ``step`` earlier ones (0-based)."""
        k = self.momentum_warmup_rounds
        if k == 0 or step >= k:
            return self.momentum
        return self.momentum * step / k

    @model_validator(mode="before")
    @classmethod
    def _average_defaults(cls, data: Any) -> Any:
        # "average" means lr 1 and no momentum; fill those in so the DiLoCo defaults of
        # the other kind never silently apply to it.
        if isinstance(data, Mapping) and data.get("kind") == "average":
            return {"lr": 1.0, "momentum": 0.0, "momentum_warmup_rounds": 0, **data}
        return data

    @model_validator(mode="after")
    def _average_is_plain(self) -> OuterOptimizerConfig:
        if self.kind == "average" and (
            self.lr != 1.0 or self.momentum != 0.0 or self.momentum_warmup_rounds != 0
        ):
            raise ValueError(
                f"kind 'average' means lr 1.0, momentum 0 and no momentum warm-up; got lr "
                f"{self.lr:g}, momentum {self.momentum:g} and momentum_warmup_rounds "
                f"{self.momentum_warmup_rounds} (use kind 'nesterov' for other values)"
            )
        return self
