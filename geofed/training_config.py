"""How a region trains inside a round: the job spec's ``training`` section, defined once.

One model serves every party that names it: the job spec (``training:``), the round
announcement that carries it to the regions, the instruction an agent hands its worker
group, and the manifest of every delta, which records what trained it. The module imports
neither torch nor the daemons, so control messages and manifests validate it cheaply.

Input is strict (no coercion: ``"2"`` is not a count, ``1`` is not a bool) and unknown
keys are refused, so a misspelt key is an error naming its file and line rather than a
setting silently left at its default.

.. code-block:: yaml

    training:
      parallelism: fsdp                # ddp (default) | fsdp (FSDP2, sharded state) |
                                       #   hsdp (sharded in groups, replicated across them)
      # hsdp_shard_ranks: 8            # hsdp: ranks per shard group (default: a node's)
      precision: bf16                  # fp32 (default) | bf16 compute, fp32 exchanged
      grad_clip_norm: 1.0              # optional: clip the global gradient norm
      grad_accumulation: 4             # micro-batches per optimizer step (default 1)
      activation_checkpointing: true   # recompute the task's checkpointed modules
      lr_schedule: {kind: warmup_cosine, warmup_steps: 100, min_lr_ratio: 0.1}

The learning-rate schedule multiplies the task's optimizer learning rate; it is indexed by
the region's inner step over the whole job (round x H + step), see :mod:`geofed.lr_schedule`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_serializer,
    model_validator,
)

from geofed.config_sections import ConfigSection

__all__ = [
    "LrSchedule",
    "Parallelism",
    "Precision",
    "ScheduleKind",
    "TrainingConfig",
    "is_sharded",
]

Parallelism = Literal["ddp", "fsdp", "hsdp"]
Precision = Literal["fp32", "bf16"]
ScheduleKind = Literal["constant", "warmup_cosine"]


def is_sharded(parallelism: str) -> bool:
    """Whether ``parallelism`` shards parameters, gradients and optimizer state (FSDP2,
    with or without a replicate dimension)."""
    return parallelism in ("fsdp", "hsdp")


class LrSchedule(ConfigSection):
    """A factor on the optimizer's learning rate, by the region's inner step over the job.

    ``constant``: the optimizer's rate at every step. ``warmup_cosine``: over the first
    ``warmup_steps`` steps the factor rises linearly to 1; from there it follows half a
    cosine down to ``min_lr_ratio`` at the job's last inner step.
    """

    kind: ScheduleKind = Field(default="constant", description="'constant' or 'warmup_cosine'")
    warmup_steps: StrictInt = Field(
        default=0, ge=0, description="warmup_cosine: steps of linear warm-up (0: none)"
    )
    min_lr_ratio: StrictFloat = Field(
        default=0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="warmup_cosine: the factor at the job's last step",
    )

    @model_validator(mode="after")
    def _constant_takes_nothing(self) -> LrSchedule:
        # Values, not presence: the JSON form of a constant schedule writes the defaults.
        given = [name for name in ("warmup_steps", "min_lr_ratio") if getattr(self, name)]
        if self.kind == "constant" and given:
            raise ValueError(f"a constant schedule takes no {' or '.join(given)}")
        return self


class TrainingConfig(ConfigSection):
    """How every region's worker group trains (the job spec's ``training`` section)."""

    parallelism: Parallelism = Field(
        default="ddp",
        description="'ddp': replicated parameters, all-reduced gradients; 'fsdp': FSDP2 "
        "with sharded parameters, gradients and optimizer state; 'hsdp': FSDP2 sharded "
        "within groups of hsdp_shard_ranks ranks and replicated across the groups",
    )
    hsdp_shard_ranks: Annotated[StrictInt, Field(ge=1, le=1 << 16)] | None = Field(
        default=None,
        description="hsdp only: the ranks each shard group spans; default: a node's ranks",
    )
    precision: Precision = Field(
        default="fp32",
        description="'bf16' computes in bfloat16; the parameters exchanged stay fp32",
    )
    grad_clip_norm: Annotated[StrictFloat, Field(gt=0, allow_inf_nan=False)] | None = Field(
        default=None, description="clip the gradient's global L2 norm to this; none if unset"
    )
    grad_accumulation: StrictInt = Field(
        default=1, ge=1, le=1 << 16, description="micro-batches per optimizer step"
    )
    activation_checkpointing: StrictBool = Field(
        default=False, description="recompute the activations of the task's checkpointed modules"
    )
    lr_schedule: LrSchedule = Field(
        default_factory=LrSchedule,
        description="learning-rate factor by the region's inner step over the whole job",
    )

    @model_validator(mode="after")
    def _shard_ranks_for_hsdp(self) -> TrainingConfig:
        if self.hsdp_shard_ranks is not None and self.parallelism != "hsdp":
            raise ValueError("hsdp_shard_ranks applies to parallelism: hsdp only")
        return self

    def record(self) -> dict[str, Any]:
        """The JSON form, as job specs, announcements and manifests carry it."""
        data: dict[str, Any] = self.model_dump(mode="json")
        return data

    @model_serializer(mode="wrap")
    def _without_unset_hsdp(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # hsdp_shard_ranks appears only when set: every other job's section, wherever it
        # is written (specs, announcements, manifests), reads as before the key existed.
        data: dict[str, Any] = handler(self)
        if data.get("hsdp_shard_ranks") is None:
            data.pop("hsdp_shard_ranks", None)
        return data
