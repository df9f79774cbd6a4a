"""The scheduler's settings: priority classes, ageing, preemption, team quotas.

.. code-block:: yaml

    priorities: {production: 100, research: 50, best-effort: 10}
    default_priority: research
    ageing: {every_s: 3600, boost: 10}      # +10 effective priority per hour waited
    fair_share: true                        # then teams holding fewer GPUs per weight
    reserve_after_s: 14400                  # a job waiting longer holds back its regions
    max_reservations: 1                     # for this many such jobs at once
    preemption:
      enabled: true
      min_priority_gap: 1                   # base priorities must differ by at least this
      snapshot_window_rounds: 1             # never stop a job this close before a snapshot
    teams:
      vision: {concurrent_gpus: 32, gpu_hours: 2000, window_s: 604800}
      nlp: {concurrent_gpus: 16, weight: 2, priorities: [research, best-effort]}

A team not listed has no quota and weight 1, and may use every priority class; a team
with ``priorities`` may submit jobs of those classes only (an admin any).
:func:`parse_scheduling_config` reads such a file and names file, line and key in every
problem.
"""

from __future__ import annotations

from pathlib import Path
from typing import Self

from pydantic import Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from coordinator.config import ConfigError
from geofed.config_sections import ConfigSection
from geofed.types import validate_name
from policies.errors import PolicyLoadError, Problem
from policies.validation import validate_document
from policies.yaml_loader import load_located

__all__ = [
    "AgeingConfig",
    "PreemptionConfig",
    "SchedulingConfig",
    "TeamBudget",
    "TeamQuota",
    "load_scheduling_config",
    "parse_scheduling_config",
]

DEFAULT_PRIORITIES = {"production": 100, "research": 50, "best-effort": 10}


class AgeingConfig(ConfigSection):
    """A waiting job's effective priority grows by ``boost`` every ``every_s`` waited."""

    every_s: StrictFloat | StrictInt = Field(default=3600, gt=0, allow_inf_nan=False)
    boost: StrictInt = Field(default=10, ge=0, description="0 turns ageing off")
    max_boost: StrictInt | None = Field(
        default=None, ge=0, description="the most ageing adds; unset: no bound, so none starves"
    )


class PreemptionConfig(ConfigSection):
    """When a job that cannot start may stop lower-priority jobs at their round boundary."""

    enabled: StrictBool = True
    min_priority_gap: StrictInt = Field(default=1, ge=1)
    snapshot_window_rounds: StrictInt = Field(
        default=1,
        ge=0,
        description="a job whose next snapshot is at most this many rounds after its next "
        "boundary is not stopped there; it is stopped after its snapshot",
    )


class TeamBudget(ConfigSection):
    """What a team may spend over a sliding window, in the price table's currency (the
    coordinator's ``prices``); watched by metrics and alerts, never enforced."""

    amount: StrictFloat | StrictInt = Field(gt=0, le=1e15, allow_inf_nan=False)
    window_s: StrictFloat | StrictInt = Field(
        default=30 * 86400, gt=0, le=366 * 86400, allow_inf_nan=False
    )


class TeamQuota(ConfigSection):
    """A team's limits (each optional) and its fair-share weight."""

    concurrent_gpus: StrictInt | None = Field(default=None, ge=0)
    gpu_hours: StrictFloat | StrictInt | None = Field(default=None, ge=0, allow_inf_nan=False)
    window_s: StrictFloat | StrictInt | None = Field(default=None, gt=0, allow_inf_nan=False)
    weight: StrictFloat | StrictInt = Field(default=1, gt=0, allow_inf_nan=False)
    priorities: tuple[str, ...] | None = Field(
        default=None,
        description="the priority classes the team's jobs may use (a class that preempts is "
        "a right); unset: every class",
    )
    budget: TeamBudget | None = Field(
        default=None, description="what the team may spend over a window (alerts only)"
    )

    @model_validator(mode="after")
    def _hours_need_a_window(self) -> Self:
        if (self.gpu_hours is None) != (self.window_s is None):
            raise ValueError("gpu_hours and window_s go together (GPU-hours per window)")
        return self


class SchedulingConfig(ConfigSection):
    """Everything the queue, admission and preemption decisions are parametrised by."""

    priorities: dict[str, StrictInt] = Field(default_factory=lambda: dict(DEFAULT_PRIORITIES))
    default_priority: str = "research"
    ageing: AgeingConfig = Field(default_factory=AgeingConfig)
    fair_share: StrictBool = Field(
        default=True,
        description="among equal effective priorities, teams holding fewer GPUs per weight "
        "go first; false: submission order",
    )
    reserve_after_s: StrictFloat | StrictInt | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="a job that has waited this long and lacks capacity keeps jobs of its "
        "class and below off the capacity it needs; unset (default): never, lower jobs fill "
        "in (without run-time estimates a hold idles capacity until the job's last region "
        "frees; see benchmarks/results/scheduling.md)",
    )
    max_reservations: StrictInt = Field(
        default=1,
        ge=0,
        description="how many such jobs have capacity held back at once (the first in queue "
        "order); more protects more waiting jobs and leaves more capacity idle",
    )
    preemption: PreemptionConfig = Field(default_factory=PreemptionConfig)
    teams: dict[str, TeamQuota] = Field(default_factory=dict)

    @field_validator("priorities")
    @classmethod
    def _priority_names(cls, value: dict[str, int]) -> dict[str, int]:
        if not value:
            raise ValueError("name at least one priority class")
        for name in value:
            validate_name("priority class", name)
        return value

    @field_validator("teams")
    @classmethod
    def _team_names(cls, value: dict[str, TeamQuota]) -> dict[str, TeamQuota]:
        for name in value:
            validate_name("team", name)
        return value

    @model_validator(mode="after")
    def _default_is_a_class(self) -> Self:
        if self.default_priority not in self.priorities:
            raise ValueError(
                f"default_priority {self.default_priority!r} is not one of the priority "
                f"classes ({', '.join(sorted(self.priorities))})"
            )
        for team, quota in self.teams.items():
            unknown = sorted(set(quota.priorities or ()) - set(self.priorities))
            if unknown:
                raise ValueError(
                    f"teams.{team}.priorities names {', '.join(unknown)}, not priority "
                    f"classes ({', '.join(sorted(self.priorities))})"
                )
        return self

    def team_priorities(self, team: str) -> frozenset[str] | None:
        """The priority classes ``team``'s jobs may use; None: every class."""
        quota = self.teams.get(team)
        if quota is None or quota.priorities is None:
            return None
        return frozenset(quota.priorities)

    def priority_of(self, name: str) -> int:
        """The number of priority class ``name``; an unknown class is an error."""
        try:
            return self.priorities[name]
        except KeyError:
            known = ", ".join(sorted(self.priorities))
            raise ValueError(f"unknown priority class {name!r} (known: {known})") from None

    def quota_of(self, team: str) -> TeamQuota:
        return self.teams.get(team, _NO_QUOTA)


_NO_QUOTA = TeamQuota()


def parse_scheduling_config(text: str, file: str) -> SchedulingConfig:
    """Parse and validate a scheduling file; raise :class:`ConfigError` with every problem."""
    try:
        return validate_document(SchedulingConfig, load_located(text, file), file)
    except PolicyLoadError as exc:
        raise ConfigError([str(problem) for problem in exc.problems]) from None


def load_scheduling_config(path: Path | None) -> SchedulingConfig:
    """Read and validate the scheduling file at ``path``; the defaults when ``path`` is None.

    Blocking (reads the file): call it off the event loop.
    """
    if path is None:
        return SchedulingConfig()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            [str(Problem(str(path), None, "(file)", f"cannot read: {exc}"))]
        ) from None
    return parse_scheduling_config(text, str(path))
