"""Adaptive round deadline from observed arrival times.

Static timeouts are either too short on a slow day (rounds fail) or too long on a
healthy one (every round waits for a region that is gone). So the next round's deadline
is estimated from the last rounds' durations from announcement to delta arrival::

    deadline = median + max(k x 1.4826 x MAD, min_slack_ratio x median)

clamped to [min_s, max_s] (1.4826 x MAD estimates a standard deviation robustly, so a
single outlier region does not move it). A straggler's true duration is unknown (it
arrived after its round's deadline, or never), so it counts as a sample at that deadline,
a lower bound. That alone would let a too-tight deadline sustain itself, so when more
than ``straggler_fraction`` of the samples are stragglers the deadline also grows to at
least ``growth`` x the last one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

from pydantic import BaseModel, ConfigDict, Field, model_validator

from geofed.timeouts import Timeouts

__all__ = ["DeadlineConfig", "DeadlineError", "RoundTiming", "next_deadline"]

_MAD_TO_SIGMA = 1.4826
#: The longest round deadline a job may set: 30 days.
MAX_DEADLINE_S = 30 * 86400.0


class DeadlineError(ValueError):
    """Unusable timing history or a deadline configuration that contradicts the timeouts."""


@dataclass(frozen=True, slots=True)
class RoundTiming:
    """What one finished round tells about arrival times, in seconds since its announcement."""

    deadline_s: float  # the round's deadline including extensions
    arrivals_s: tuple[float, ...]  # one per region whose delta was accepted
    stragglers: int = 0  # participants that did not deliver in time

    def __post_init__(self) -> None:
        if not (math.isfinite(self.deadline_s) and self.deadline_s > 0):
            raise DeadlineError(f"deadline_s must be a positive number, got {self.deadline_s!r}")
        if not all(math.isfinite(a) for a in self.arrivals_s):
            raise DeadlineError(f"arrival times must be finite, got {self.arrivals_s!r}")
        if self.stragglers < 0:
            raise DeadlineError(f"stragglers must be >= 0, got {self.stragglers}")


class DeadlineConfig(BaseModel):
    """Bounds and sensitivity of the adaptive round deadline (seconds)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    initial_s: float = Field(
        default=1800.0,
        gt=0,
        le=MAX_DEADLINE_S,
        allow_inf_nan=False,
        description="Used until enough samples exist.",
    )
    min_s: float = Field(
        default=600.0, gt=0, le=MAX_DEADLINE_S, allow_inf_nan=False, description="Lower bound."
    )
    max_s: float = Field(
        default=14400.0, gt=0, le=MAX_DEADLINE_S, allow_inf_nan=False, description="Upper bound."
    )
    k: float = Field(default=3.0, ge=0, allow_inf_nan=False, description="MAD multiplier.")
    min_slack_ratio: float = Field(
        default=0.25,
        ge=0,
        allow_inf_nan=False,
        description="Slack of at least this fraction of the median, for when all agree.",
    )
    window_rounds: int = Field(
        default=10, ge=1, le=10_000, description="How many recent rounds count."
    )
    min_samples: int = Field(default=3, ge=1, le=10_000, description="Samples needed to adapt.")
    straggler_fraction: float = Field(
        default=0.2, ge=0, le=1, description="Above this share of stragglers, grow."
    )
    growth: float = Field(default=1.5, gt=1, allow_inf_nan=False, description="Growth factor.")

    @model_validator(mode="after")
    def _bounds(self) -> DeadlineConfig:
        if not self.min_s <= self.initial_s <= self.max_s:
            raise ValueError(
                f"need min_s <= initial_s <= max_s, got min_s {self.min_s:g}, "
                f"initial_s {self.initial_s:g}, max_s {self.max_s:g}"
            )
        return self

    def check_against(self, timeouts: Timeouts) -> None:
        """Refuse a minimum deadline that a single permitted upload could outlast."""
        if not self.min_s > timeouts.upload_s:
            raise DeadlineError(
                f"deadline min_s ({self.min_s:g}) must be greater than the coordinator's "
                f"timeouts.upload_s ({timeouts.upload_s:g}): a round must outlast one upload; "
                "raise the job's deadline.min_s (and initial_s) or lower timeouts.upload_s "
                "in the coordinator's config"
            )


def _clamp(value: float, config: DeadlineConfig) -> tuple[float, str]:
    if value < config.min_s:
        return config.min_s, f", raised to the minimum {config.min_s:g} s"
    if value > config.max_s:
        return config.max_s, f", capped at the maximum {config.max_s:g} s"
    return value, ""


def next_deadline(history: Sequence[RoundTiming], config: DeadlineConfig) -> tuple[float, str]:
    """Return the next round's deadline in seconds and the reason for it.

    ``history`` is oldest first; only the last ``config.window_rounds`` rounds count.
    Negative arrival times (a wall clock stepped back) count as 0.
    """
    window = list(history)[-config.window_rounds :]
    samples: list[float] = []
    censored = 0
    for timing in window:
        samples.extend(max(0.0, a) for a in timing.arrivals_s)
        samples.extend([timing.deadline_s] * timing.stragglers)
        censored += timing.stragglers
    if len(samples) < config.min_samples:
        value, clamp = _clamp(config.initial_s, config)
        return value, (
            f"only {len(samples)} arrival sample(s) (need {config.min_samples}); "
            f"using the initial deadline {config.initial_s:g} s{clamp}"
        )
    mid = median(samples)
    mad = median(abs(s - mid) for s in samples)
    spread = config.k * _MAD_TO_SIGMA * mad
    floor = config.min_slack_ratio * mid
    if spread >= floor:
        slack_text = f"{config.k:g} x 1.4826 x MAD {mad:.1f} s = {spread:.1f} s"
    else:
        slack_text = f"minimum slack {config.min_slack_ratio:g} x median = {floor:.1f} s"
    estimate = mid + max(spread, floor)
    reason = (
        f"median {mid:.1f} s + {slack_text} over {len(samples)} samples from the last "
        f"{len(window)} round(s) = {estimate:.1f} s"
    )
    share = censored / len(samples)
    if share > config.straggler_fraction:
        grown = window[-1].deadline_s * config.growth
        if grown > estimate:
            estimate = grown
            reason += (
                f"; {censored} of {len(samples)} samples were stragglers "
                f"({share:.0%} > {config.straggler_fraction:.0%}), so grown to "
                f"{config.growth:g} x the last deadline {window[-1].deadline_s:g} s = {grown:.1f} s"
            )
    value, clamp = _clamp(estimate, config)
    return value, reason + clamp
