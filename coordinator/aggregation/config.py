"""How a job combines its regions' deltas: the job spec's ``aggregation`` section.

.. code-block:: yaml

    aggregation:
      rule: median                     # mean (default) | trimmed_mean | median
      trim_fraction: 0.2               # trimmed_mean: share dropped at each end per coordinate
      norm_check: clip                 # off (default) | clip | refuse
      max_norm_ratio: 3.0              # a delta's L2 norm against the round's median norm
      max_tokens_per_round: 1000000    # the most tokens one region may claim for a round
      late: merge                      # drop (default) | merge: a delta that missed its round
      max_staleness: 2                 # merge: the most rounds a merged delta may be behind
      grace_s: 30                      # merge: quorum to close; default: from arrival slack

``mean`` weights each region by the tokens it claims; ``trimmed_mean`` and ``median`` are
coordinate-wise and unweighted, since a claimed weight is what a hostile region controls.
Claims above ``max_tokens_per_round`` are refused at upload (``tokens_out_of_bounds``);
unset, the bound is ``inner_steps`` x :data:`MAX_TOKENS_PER_STEP`.

``late: merge`` takes a delta that arrives after its round closed into the round that is
open when it comes, at the weight :func:`coordinator.rounds.late.staleness_weight` gives
(its tokens / (1 + staleness)), up to ``max_staleness`` rounds behind; a round then closes
a grace window after its quorum arrived instead of at its deadline
(:func:`coordinator.rounds.late.grace_window`). It needs the token-weighted ``mean``
(the coordinate-wise rules have no weight to discount) and an overlap other than
``streaming`` (a late delta's fragment is not the open round's).
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import BeforeValidator, Field, StrictFloat, StrictInt, model_validator

from geofed.config_sections import ConfigSection

__all__ = [
    "MAX_STALENESS",
    "MAX_TOKENS_PER_STEP",
    "AggregationConfig",
    "AggregationRule",
    "LateDeltas",
    "NormCheck",
]

AggregationRule = Literal["mean", "trimmed_mean", "median"]
NormCheck = Literal["off", "clip", "refuse"]
LateDeltas = Literal["drop", "merge"]

#: The most rounds behind a job may let a merged delta be: beyond that, a delta trained
#: from so old a θ is noise for the outer step, and the coordinator keeps that many
#: rounds' records at hand to judge it.
MAX_STALENESS: Final = 16


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

    late: LateDeltas = Field(
        default="drop",
        description="a delta that arrives after its round closed: 'drop' refuses it (409 "
        "round_closed); 'merge' takes it into the open round at a staleness weight",
    )
    max_staleness: StrictInt = Field(
        default=2,
        ge=1,
        le=MAX_STALENESS,
        description="late merge: the most rounds a merged delta may be behind the round that "
        "takes it",
    )
    grace_s: StrictFloat | None = Field(
        default=None,
        gt=0,
        le=30 * 86400.0,
        allow_inf_nan=False,
        description="late merge: seconds a round waits after its quorum arrived before it "
        "closes (never past its deadline); default: sized from the recent rounds' arrival slack",
    )

    @model_validator(mode="after")
    def _merge_needs_weights(self) -> AggregationConfig:
        if self.late == "merge" and self.rule != "mean":
            raise ValueError(
                f"late merge needs rule mean: {self.rule} is unweighted, so a stale delta "
                "would count as much as a fresh one"
            )
        return self

    def token_bound(self, inner_steps: int) -> int:
        """The most tokens a region may claim for a round of ``inner_steps`` steps."""
        if self.max_tokens_per_round is not None:
            return self.max_tokens_per_round
        return inner_steps * MAX_TOKENS_PER_STEP
