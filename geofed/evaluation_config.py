"""Where a job's global parameters are evaluated: the job spec's ``evaluation`` section.

One model serves the job spec (``evaluation:``), the round announcement that carries it
to the regions, and both daemons' decisions. Like :mod:`geofed.training_config` it
imports neither torch nor the daemons, and its input is strict with unknown keys refused.

.. code-block:: yaml

    evaluation:
      where: region          # region (default) | region:NAME | regions | coordinator | none
      every: 1               # evaluate θ_r of rounds r with r % every == 0 (default 1)

A region evaluates θ_r on its own accelerator at the start of round r, right after it
loaded θ_r and before training from it, and sends the metrics in its delta's manifest
(``base_eval``); the coordinator records them when it accepts that delta. ``region`` is
the first of the round's participants by name, so the evaluation follows the round even
when a region is quarantined; ``region:NAME`` is that region, and nobody when it does not
take part in the round; ``regions`` is every participant (the coordinator keeps the first
it accepts). ``coordinator`` evaluates on the coordinator, in a process of its own, never
in the pool that aggregates. The job's last parameters θ_rounds are the base of no round,
so the coordinator evaluates them (the job's result) unless ``where`` is ``none``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

from pydantic import Field, StrictInt, StrictStr, field_validator

from geofed.config_sections import ConfigSection
from geofed.types import validate_name

__all__ = [
    "EvaluationConfig",
    "EvaluationDecision",
    "coordinator_evaluates",
    "region_evaluates",
]

_KEYWORDS: Final = frozenset({"region", "regions", "coordinator", "none"})
_NAMED: Final = re.compile(r"^region:(?P<name>.+)$")


class EvaluationConfig(ConfigSection):
    """Where and how often the global parameters are evaluated (see the module docstring)."""

    where: StrictStr = Field(
        default="region",
        description="'region' (the round's first participant by name), 'region:NAME', "
        "'regions' (every participant), 'coordinator' (its own process) or 'none'",
    )
    every: StrictInt = Field(
        default=1, ge=1, le=1 << 30, description="evaluate θ_r of rounds r with r % every == 0"
    )

    @field_validator("where")
    @classmethod
    def _known_place(cls, value: str) -> str:
        if value in _KEYWORDS:
            return value
        named = _NAMED.match(value)
        if named is None:
            raise ValueError(
                f"{value!r} is not one of region, region:NAME, regions, coordinator, none"
            )
        validate_name("region", named["name"])
        return value

    @property
    def region(self) -> str | None:
        """The region ``region:NAME`` names; None for every other ``where``."""
        named = _NAMED.match(self.where)
        return None if named is None else named["name"]

    def record(self) -> dict[str, Any]:
        """The JSON form, as job specs and announcements carry it."""
        data: dict[str, Any] = self.model_dump(mode="json")
        return data


@dataclass(frozen=True, slots=True)
class EvaluationDecision:
    """Whether to evaluate, and why (for logs and tests)."""

    evaluate: bool
    reason: str


def region_evaluates(
    config: EvaluationConfig, region: str, round_: int, participants: tuple[str, ...]
) -> EvaluationDecision:
    """Whether ``region`` evaluates θ_round before it trains round ``round_``."""
    if config.where in ("coordinator", "none"):
        return EvaluationDecision(False, f"evaluation is on the {config.where}")
    if round_ % config.every:
        return EvaluationDecision(False, f"round {round_} is not a multiple of {config.every}")
    if region not in participants:
        return EvaluationDecision(False, f"{region} does not take part in round {round_}")
    if config.where == "regions":
        return EvaluationDecision(True, "every participant evaluates")
    chosen = config.region if config.where != "region" else min(participants)
    if chosen == region:
        return EvaluationDecision(True, f"{config.where} evaluates")
    return EvaluationDecision(False, f"{chosen} evaluates, not {region}")


def coordinator_evaluates(
    config: EvaluationConfig, version: int, total_rounds: int
) -> EvaluationDecision:
    """Whether the coordinator evaluates θ_version of a job of ``total_rounds`` rounds."""
    if config.where == "none":
        return EvaluationDecision(False, "evaluation is off")
    if version >= total_rounds:
        return EvaluationDecision(True, "the job's last parameters are the base of no round")
    if config.where != "coordinator":
        return EvaluationDecision(False, f"θ_{version} is evaluated by {config.where}")
    if version % config.every:
        return EvaluationDecision(False, f"version {version} is not a multiple of {config.every}")
    return EvaluationDecision(True, "evaluation is on the coordinator")
