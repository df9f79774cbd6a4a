"""Quarantine of regions that keep failing or straggling, and their way back in.

After ``max_consecutive_bad`` bad rounds in a row (straggled, or delivered something
that was refused) a region is left out of the next rounds until its cool-down has passed:
``cooldown_rounds`` rounds sat out and ``cooldown_s`` seconds elapsed (both, where both
are set). It then comes back on probation: with ``probation`` set, one more bad round
sends it straight back; one good round clears it.

Quarantine never stalls a job: :meth:`Quarantine.select` admits quarantined regions
early, those due back soonest first, when the rest cannot make ``min_regions``.
Recording is idempotent per (region, round), so replaying outcomes after a restart is safe.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from geofed.types import InvalidName, validate_name

__all__ = [
    "Outcome",
    "Quarantine",
    "QuarantineConfig",
    "QuarantineDecision",
    "QuarantineError",
    "Selection",
    "round_outcomes",
]


class QuarantineError(ValueError):
    """Bad input (name, round, time) or an unusable saved state; nothing was changed."""


class Outcome(StrEnum):
    DELIVERED = "delivered"
    STRAGGLER = "straggler"  # did not deliver before the round closed
    FAILED = "failed"  # delivered something that was refused, or failed to resync


def round_outcomes(
    included: Iterable[str], stragglers: Iterable[str], merged: Iterable[str] = ()
) -> dict[str, Outcome]:
    """Each participant's outcome of a published round: delivered if it was included, or
    if a late delta of its own (an earlier round's) was ``merged`` into it, since its work
    reached θ all the same (``aggregation.late: merge``); a straggler otherwise."""
    late = set(merged)
    outcomes = dict.fromkeys(included, Outcome.DELIVERED)
    for region in stragglers:
        outcomes[region] = Outcome.DELIVERED if region in late else Outcome.STRAGGLER
    return outcomes


class QuarantineConfig(BaseModel):
    """When a region is quarantined and when it may come back."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_consecutive_bad: int = Field(default=3, ge=1, description="Bad rounds in a row.")
    cooldown_rounds: int = Field(default=5, ge=0, description="Rounds to sit out.")
    cooldown_s: float = Field(default=0.0, ge=0, allow_inf_nan=False, description="And seconds.")
    probation: bool = Field(default=True, description="One bad round after release re-enters.")

    @model_validator(mode="after")
    def _some_cooldown(self) -> QuarantineConfig:
        if self.cooldown_rounds == 0 and self.cooldown_s == 0:
            raise ValueError("a cool-down is needed: set cooldown_rounds or cooldown_s above 0")
        return self


class RegionRecord(BaseModel):
    """What the quarantine remembers about one region."""

    model_config = ConfigDict(extra="forbid")

    consecutive_bad: int = Field(default=0, ge=0)
    last_round: int | None = Field(default=None, ge=0)
    quarantined_round: int | None = Field(default=None, ge=0)  # kept until a good round
    quarantined_at: float | None = Field(default=None, allow_inf_nan=False)
    times_quarantined: int = Field(default=0, ge=0)
    reason: str = ""


@dataclass(frozen=True, slots=True)
class QuarantineDecision:
    region: str
    quarantined: bool
    changed: bool  # whether this call put the region in or took it out
    reason: str


@dataclass(frozen=True, slots=True)
class Selection:
    """Who to invite to a round; ``excluded`` maps each left-out region to why."""

    participants: tuple[str, ...]
    excluded: Mapping[str, str] = field(hash=False)
    reason: str


class Quarantine:
    """Per-region standing; pure: every call takes the round number and ``now``."""

    def __init__(self, config: QuarantineConfig | None = None) -> None:
        self._config = config if config is not None else QuarantineConfig()
        self._records: dict[str, RegionRecord] = {}

    @property
    def config(self) -> QuarantineConfig:
        return self._config

    def _due(self, rec: RegionRecord) -> str:
        parts = []
        if self._config.cooldown_rounds:
            since = rec.quarantined_round or 0
            parts.append(f"round {since + 1 + self._config.cooldown_rounds}")
        if self._config.cooldown_s:
            parts.append(f"t={(rec.quarantined_at or 0.0) + self._config.cooldown_s:.3f}")
        return " and ".join(parts)

    def _in_cooldown(self, rec: RegionRecord, round: int, now: float) -> bool:
        if rec.quarantined_round is None or rec.quarantined_at is None:
            return False
        cfg = self._config
        rounds_left = round < rec.quarantined_round + 1 + cfg.cooldown_rounds
        seconds_left = now < rec.quarantined_at + cfg.cooldown_s
        return rounds_left or seconds_left

    def status(self, region: str, round: int, now: float) -> QuarantineDecision:
        """Whether ``region`` is quarantined for ``round`` at ``now``, and why."""
        _check(region, round, now)
        rec = self._records.get(region)
        if rec is None or rec.quarantined_round is None:
            return QuarantineDecision(region, False, False, f"{region} is in good standing")
        if self._in_cooldown(rec, round, now):
            return QuarantineDecision(
                region, True, False, f"{region} is quarantined until {self._due(rec)}: {rec.reason}"
            )
        return QuarantineDecision(
            region, False, False, f"{region} is back on probation after: {rec.reason}"
        )

    def record(self, region: str, round: int, outcome: Outcome, now: float) -> QuarantineDecision:
        """Fold one round's outcome for ``region`` into its standing."""
        _check(region, round, now)
        outcome = Outcome(outcome)
        rec = self._records.get(region, RegionRecord())
        if rec.last_round is not None and round <= rec.last_round:
            if round < rec.last_round:
                raise QuarantineError(
                    f"{region}: round {round} is older than the last recorded round "
                    f"{rec.last_round}"
                )
            held = self._in_cooldown(rec, round, now)
            return QuarantineDecision(
                region, held, False, f"{region}: round {round} was already recorded; ignored"
            )
        rec = rec.model_copy()
        rec.last_round = round
        held = self._in_cooldown(rec, round, now)
        was_quarantined = rec.quarantined_round is not None
        if outcome is Outcome.DELIVERED:
            rec.consecutive_bad = 0
            rec.quarantined_round = rec.quarantined_at = None
            self._records[region] = rec
            if was_quarantined:
                return QuarantineDecision(
                    region, False, held, f"{region} delivered round {round}: back in good standing"
                )
            return QuarantineDecision(region, False, False, f"{region} delivered round {round}")
        rec.consecutive_bad += 1
        bad = f"{outcome.value} in round {round}"
        if held:
            why = f"{bad} while still quarantined (admitted early); cool-down restarts"
        elif was_quarantined and self._config.probation:
            why = f"{bad} while on probation"
        elif rec.consecutive_bad >= self._config.max_consecutive_bad:
            plural = "s" if rec.consecutive_bad != 1 else ""
            why = f"{rec.consecutive_bad} consecutive bad round{plural}, the last {bad}"
        else:
            self._records[region] = rec
            return QuarantineDecision(
                region,
                False,
                False,
                f"{region}: {bad} ({rec.consecutive_bad} of "
                f"{self._config.max_consecutive_bad} consecutive bad rounds before quarantine)",
            )
        rec.quarantined_round, rec.quarantined_at, rec.reason = round, now, why
        rec.consecutive_bad = 0  # after release, the count starts over (probation aside)
        rec.times_quarantined += 0 if held else 1
        self._records[region] = rec
        return QuarantineDecision(
            region, True, not held, f"{region} quarantined until {self._due(rec)}: {why}"
        )

    def select(
        self, candidates: Iterable[str], round: int, now: float, min_regions: int
    ) -> Selection:
        """Choose a round's participants: everyone not quarantined, enough to make quorum."""
        eligible: list[str] = []
        held: list[tuple[int, float, str]] = []
        excluded: dict[str, str] = {}
        for region in sorted(set(candidates)):
            verdict = self.status(region, round, now)
            if verdict.quarantined:
                rec = self._records[region]
                held.append((rec.quarantined_round or 0, rec.quarantined_at or 0.0, region))
                excluded[region] = verdict.reason
            else:
                eligible.append(region)
        reason = f"{len(eligible)} eligible, {len(held)} quarantined"
        if len(eligible) < min_regions and held:
            early = [region for _, _, region in sorted(held)[: min_regions - len(eligible)]]
            for region in early:
                del excluded[region]
            eligible.extend(early)
            reason += (
                f"; quorum needs {min_regions}, so admitting {', '.join(early)} early "
                "(due back soonest)"
            )
        if len(eligible) < min_regions:
            reason += f"; only {len(eligible)} candidate(s) for a quorum of {min_regions}"
        return Selection(tuple(sorted(eligible)), excluded, reason)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict of every region's record."""
        return {
            "regions": {name: rec.model_dump(mode="json") for name, rec in self._records.items()}
        }

    @classmethod
    def from_dict(cls, config: QuarantineConfig, data: Any) -> Quarantine:
        """Rebuild from :meth:`to_dict` output; raise :class:`QuarantineError` if unusable."""
        if not isinstance(data, Mapping) or not isinstance(data.get("regions"), Mapping):
            raise QuarantineError("saved quarantine state must be a mapping with 'regions'")
        quarantine = cls(config)
        for name, raw in data["regions"].items():
            try:
                validate_name("region", name)
                rec = RegionRecord.model_validate(raw)
            except (InvalidName, ValidationError) as exc:
                raise QuarantineError(
                    f"saved quarantine record {name!r} is invalid: {exc}"
                ) from None
            if (rec.quarantined_round is None) != (rec.quarantined_at is None):
                raise QuarantineError(
                    f"saved quarantine record {name!r} needs both or neither of "
                    "quarantined_round and quarantined_at"
                )
            quarantine._records[name] = rec
        return quarantine


def _check(region: str, round: int, now: float) -> None:
    try:
        validate_name("region", region)
    except InvalidName as exc:
        raise QuarantineError(str(exc)) from None
    if isinstance(round, bool) or not isinstance(round, int) or round < 0:
        raise QuarantineError(f"round must be an integer >= 0, got {round!r}")
    if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
        raise QuarantineError(f"now must be a finite number of seconds, got {now!r}")
