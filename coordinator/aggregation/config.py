"""How a job combines its regions' deltas: the job spec's ``aggregation`` section.

.. code-block:: yaml

    aggregation:
      rule: median                     # mean (default) | trimmed_mean | median
      trim_fraction: 0.2               # trimmed_mean: share dropped at each end per coordinate
      norm_check: clip                 # off (default) | clip | refuse
      max_norm_ratio: 3.0              # a delta's L2 norm against the round's median norm
      max_tokens_per_round: 1000000    # the most tokens one region may claim for a round

``mean`` weights each region by the tokens it claims; ``trimmed_mean`` and ``median`` are
coordinate-wise and unweighted, since a claimed weight is what a hostile region controls.
Claims above ``max_tokens_per_round`` are refused at upload (``tokens_out_of_bounds``);
unset, the bound is ``inner_steps`` x :data:`MAX_TOKENS_PER_STEP`.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import BeforeValidator, Field, StrictFloat, StrictInt

from geofed.config_sections import ConfigSection

__all__ = ["MAX_TOKENS_PER_STEP", "AggregationConfig", "AggregationRule", "NormCheck"]

AggregationRule = Literal["mean", "trimmed_mean", "median"]
NormCheck = Literal["off", "clip", "refuse"]


def _off_from_yaml11(value: object) -> object:
    # YAML 1.1 tools (PyYAML's safe_load among them) read a bare `off` as false; a spec
    # that went through one arrives with false where the operator wrote off.
    return "off" if value is False else value


#: Tokens one region may claim per inner step unless the job sets its own bound: 2^24,
#: above the global batch of any published pre-training run, so only a lie exceeds it.
MAX_TOKENS_PER_STEP: Final = 1 << 24


class AggregationConfig(ConfigSection):
    """The rule that averages a round's deltas, and what one region may weigh in it."""

    rule: AggregationRule = Field(
        default="mean",
        description="'mean': token-weighted; 'trimmed_mean', 'median': coordinate-wise, unweighted",
    )
    trim_fraction: StrictFloat = Field(
        default=0.1,
        ge=0,
        lt=0.5,
        allow_inf_nan=False,
        description="trimmed_mean: the share of regions dropped at each end of every coordinate",
    )
    norm_check: Annotated[NormCheck, BeforeValidator(_off_from_yaml11)] = Field(
        default="off",
        description="a delta whose L2 norm exceeds max_norm_ratio x the round's median norm is "
        "scaled down to it ('clip') or left out of the round ('refuse')",
    )
    max_norm_ratio: StrictFloat = Field(
        default=3.0, gt=1, allow_inf_nan=False, description="see norm_check"
    )
    max_tokens_per_round: StrictInt | None = Field(
        default=None,
        ge=1,
        lt=2**63,
        description="the most tokens a region may claim for one round; default: inner_steps "
        f"x {MAX_TOKENS_PER_STEP}",
    )

    def token_bound(self, inner_steps: int) -> int:
        """The most tokens a region may claim for a round of ``inner_steps`` steps."""
        if self.max_tokens_per_round is not None:
            return self.max_tokens_per_round
        return inner_steps * MAX_TOKENS_PER_STEP
