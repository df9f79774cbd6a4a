"""When a job takes a global snapshot: every K rounds, or at the interval it measures.

``snapshot_every: K`` (the default, 10) snapshots θ_v whenever v is a multiple of K.
``snapshot_every: auto`` chooses the interval from what the coordinator measured of the
job (:class:`SnapshotStats`): the wall seconds a snapshot takes (δ), the job's round
duration, and the failures of its regions over their exposure (each region's MTBF;
the job's combined MTBF M). :func:`plan_interval` turns them into whole rounds with
:func:`coordinator.scheduling.checkpoint_interval.snapshot_interval` (τ ≈ √(2·δ·M),
bounded by ``snapshot_min_rounds`` and ``snapshot_max_rounds``); :func:`decide_snapshot`
says, at each publication, whether the new θ is snapshotted: once the rounds since the
newest snapshot in the chain reach the interval. Snapshot rounds are then irregular:
whatever reads the chain finds them by listing it. In either mode, a job whose hardware
risk (:mod:`coordinator.scheduling.hardware_risk`) reaches 0.7 snapshots at once, and
again only if it rises further or falls back and rises anew (:func:`risk_snapshot`).
While the job's validation loss falls steadily, an auto interval measured from cost and
failures is stretched (:mod:`coordinator.publication.loss_trend`).

A job with no snapshot cost measured yet takes its shortest interval (to measure one);
with no failure observed, its longest. :func:`load_stats` and :func:`save_stats` keep
the measurements in the coordinator's state directory, so a restart goes on from them.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from coordinator.jobs.spec import JobSpec
from coordinator.publication.loss_trend import LossTrend
from coordinator.scheduling.checkpoint_interval import (
    combined_mtbf,
    observed_mtbf,
    snapshot_interval,
)
from coordinator.scheduling.hardware_risk import REARM_RISK, RISK_STEP, SNAPSHOT_RISK, Risk
from geofed.fsutil import atomic_write_bytes

__all__ = [
    "SnapshotDecision",
    "SnapshotMode",
    "SnapshotPlan",
    "SnapshotSettings",
    "SnapshotStats",
    "decide_snapshot",
    "decide_state_save",
    "load_stats",
    "next_snapshot_round",
    "plan_interval",
    "rearmed",
    "risk_snapshot",
    "save_stats",
    "snapshot_status",
]

log = logging.getLogger(__name__)

SnapshotMode = Literal["fixed", "auto"]


@dataclass(frozen=True, slots=True)
class SnapshotSettings:
    """A job's snapshot settings: ``every`` K rounds (None: auto, within the bounds)."""

    every: int | None
    min_rounds: int = 1
    max_rounds: int = 100

    @classmethod
    def of(cls, spec: JobSpec) -> SnapshotSettings:
        return cls(spec.fixed_snapshot_every, spec.snapshot_min_rounds, spec.snapshot_max_rounds)

    @property
    def mode(self) -> SnapshotMode:
        return "auto" if self.every is None else "fixed"


@dataclass
class SnapshotStats:
    """What the coordinator measured of one job (running sums, so means survive restarts)."""

    cost_s_sum: float = 0.0
    cost_count: int = 0
    round_s_sum: float = 0.0
    round_count: int = 0
    #: region -> failures observed while it served the job, and its exposure in seconds
    #: (the wall time of the job's published rounds).
    failures: dict[str, int] = field(default_factory=dict)
    exposure_s: dict[str, float] = field(default_factory=dict)
    #: region -> what its newest failure was ("offline", "missed the deadline").
    last_failure: dict[str, str] = field(default_factory=dict)
    #: region -> when (wall time) it failed lately: the hardware risk counts the last hour's.
    failed_at: dict[str, list[float]] = field(default_factory=dict)
    #: The regions drained for their risk, until it fell below the re-arm score: an
    #: operator who starts one again is not overruled by a restarted coordinator.
    drained: set[str] = field(default_factory=set)

    @property
    def cost_s(self) -> float | None:
        """Mean wall seconds of the job's snapshots; None before any was measured."""
        return self.cost_s_sum / self.cost_count if self.cost_count else None

    @property
    def round_s(self) -> float | None:
        """Mean wall seconds of the job's published rounds; None before any."""
        return self.round_s_sum / self.round_count if self.round_count else None

    def snapshot_took(self, seconds: float) -> None:
        self.cost_s_sum += max(0.0, seconds)
        self.cost_count += 1

    def round_took(self, seconds: float, regions: Iterable[str]) -> None:
        """A published round of ``seconds``; each of ``regions`` served the job for it."""
        seconds = max(0.0, seconds)
        self.round_s_sum += seconds
        self.round_count += 1
        for region in regions:
            self.exposure_s[region] = self.exposure_s.get(region, 0.0) + seconds

    def region_failed(self, region: str, what: str) -> None:
        self.failures[region] = self.failures.get(region, 0) + 1
        self.last_failure[region] = what

    def region_mtbf_s(self, region: str) -> float | None:
        return observed_mtbf(self.failures.get(region, 0), self.exposure_s.get(region, 0.0))

    def mtbf_s(self, regions: Iterable[str]) -> float | None:
        """The combined MTBF of ``regions``: the job fails when any of them does."""
        return combined_mtbf(self.region_mtbf_s(region) for region in regions)

    def to_json(self) -> dict[str, Any]:
        return {
            "cost_s_sum": self.cost_s_sum,
            "cost_count": self.cost_count,
            "round_s_sum": self.round_s_sum,
            "round_count": self.round_count,
            "failures": dict(self.failures),
            "exposure_s": dict(self.exposure_s),
            "last_failure": dict(self.last_failure),
            "failed_at": {region: list(times) for region, times in self.failed_at.items()},
            "drained": sorted(self.drained),
        }

    @classmethod
    def from_json(cls, data: object) -> SnapshotStats:
        """Rebuild saved stats; :class:`ValueError` if they are not what :meth:`to_json` wrote."""
        try:
            data = _object(data)
            stats = cls(
                cost_s_sum=float(data["cost_s_sum"]),
                cost_count=int(data["cost_count"]),
                round_s_sum=float(data["round_s_sum"]),
                round_count=int(data["round_count"]),
                failures={str(k): int(v) for k, v in dict(data["failures"]).items()},
                exposure_s={str(k): float(v) for k, v in dict(data["exposure_s"]).items()},
                last_failure={str(k): str(v) for k, v in dict(data["last_failure"]).items()},
                # Absent from the files of coordinators before them.
                failed_at={
                    str(k): [float(at) for at in _list(v)]
                    for k, v in dict(data.get("failed_at", {})).items()
                },
                drained={str(region) for region in _list(data.get("drained", []))},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed: {exc}") from None
        times = [at for ats in stats.failed_at.values() for at in ats]
        numbers = (stats.cost_s_sum, stats.round_s_sum, *stats.exposure_s.values(), *times)
        counts = (stats.cost_count, stats.round_count, *stats.failures.values())
        if any(not math.isfinite(x) or x < 0 for x in numbers) or any(n < 0 for n in counts):
            raise ValueError("negative or non-finite measurement")
        return stats


def _list(data: object) -> list[Any]:
    if not isinstance(data, list):
        raise TypeError(f"expected a list, got {type(data).__name__}")
    return data


def _object(data: object) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise TypeError("not an object")
    return data


@dataclass(frozen=True, slots=True)
class SnapshotPlan:
    """The interval chosen now, why, and the measurements it came from."""

    mode: SnapshotMode
    every_rounds: int
    tau_s: float | None
    reason: str
    cost_s: float | None
    mtbf_s: float | None


def plan_interval(
    settings: SnapshotSettings,
    stats: SnapshotStats,
    regions: Iterable[str],
    round_s: float | None,
    trend: LossTrend | None = None,
) -> SnapshotPlan:
    """The job's snapshot interval from its settings and measurements.

    ``round_s`` is the job's round duration (its measured mean, or the current round's
    before any was measured); ``trend``: its validation loss's
    (:func:`~coordinator.publication.loss_trend.loss_trend`), which stretches a measured
    auto interval while the loss falls steadily (None: not known).
    """
    regions = tuple(regions)
    cost, mtbf = stats.cost_s, stats.mtbf_s(regions)
    if settings.every is not None:
        every = settings.every
        return SnapshotPlan("fixed", every, None, f"snapshot_every: {every}", cost, mtbf)
    low, high = settings.min_rounds, settings.max_rounds
    if cost is None or round_s is None or round_s <= 0 or not math.isfinite(round_s):
        missing = "snapshot cost" if cost is None else "round duration"
        return SnapshotPlan(
            "auto",
            low,
            None,
            f"no {missing} measured yet: the job's shortest interval, to measure one",
            cost,
            mtbf,
        )
    chosen = snapshot_interval(cost, mtbf, round_s, min_rounds=low, max_rounds=high)
    reason = chosen.reason
    if mtbf is not None:
        failed = sorted(r for r in regions if stats.failures.get(r))
        seen = ", ".join(
            f"{r}: {stats.failures[r]} in {stats.exposure_s.get(r, 0.0):.0f} s "
            f"(last: {stats.last_failure.get(r, 'failure')})"
            for r in failed
        )
        reason += f"; measured MTBF {mtbf:.0f} s from the failures seen ({seen})"
    rounds = chosen.rounds
    if trend is not None and trend.stretch == 1:
        reason += f"; not stretched: {trend.reason}"
    elif trend is not None:
        stretched = min(high, rounds * trend.stretch)
        if stretched > rounds:
            reason += f"; x{trend.stretch} ({rounds} -> {stretched} rounds) while {trend.reason}"
        else:
            reason += f"; at snapshot_max_rounds already while {trend.reason}"
        rounds = stretched
    return SnapshotPlan("auto", rounds, chosen.tau_s, reason, cost, mtbf)


@dataclass(frozen=True, slots=True)
class SnapshotDecision:
    """Whether the θ being published is snapshotted, and why."""

    take: bool
    reason: str


def decide_snapshot(version: int, last_round: int | None, plan: SnapshotPlan) -> SnapshotDecision:
    """Whether θ_version, published now, gets a snapshot; ``last_round``: the version of
    the newest snapshot in the job's chain (None: none there)."""
    every = plan.every_rounds
    if plan.mode == "fixed":
        if version % every == 0:
            return SnapshotDecision(True, f"round {version} is a multiple of {every}")
        return SnapshotDecision(False, f"round {version} is not a multiple of {every}")
    if last_round is None:
        return SnapshotDecision(True, "no snapshot in the job's chain")
    since = version - last_round
    if since >= every:
        return SnapshotDecision(
            True, f"{since} round(s) since the snapshot of round {last_round}: interval {every}"
        )
    return SnapshotDecision(
        False, f"{since} round(s) since the snapshot of round {last_round}, below {every}"
    )


def risk_snapshot(risk: Risk, acted_at: float | None) -> SnapshotDecision | None:
    """A snapshot at once because the job's hardware risk reached
    :data:`~coordinator.scheduling.hardware_risk.SNAPSHOT_RISK`; ``acted_at``: the score a
    risk snapshot was last taken at, while the risk has not fallen below
    :data:`~coordinator.scheduling.hardware_risk.REARM_RISK` since (None: none such).
    Again only at a rise of ``RISK_STEP`` over it. None: no such cause."""
    if risk.score < SNAPSHOT_RISK:
        return None
    if acted_at is not None and risk.score < acted_at + RISK_STEP:
        return None
    return SnapshotDecision(
        True, f"hardware risk {risk.score:.2f} reached {SNAPSHOT_RISK}: {risk.reason}"
    )


def rearmed(risk: Risk, acted_at: float | None) -> float | None:
    """``acted_at`` after the risk is ``risk``: forgotten once it fell below REARM_RISK."""
    return None if risk.score < REARM_RISK else acted_at


def decide_state_save(
    version: int, saved: int | None, *, snapshot: bool, last: bool, every: int
) -> SnapshotDecision:
    """Whether the coordinator saves θ_version's working state (θ, the outer optimizer
    state, the residual: three model-sized blobs) as it publishes it, and why.

    It does with every snapshot, at the job's last round, and once ``every`` rounds
    (the job's ``working_state_every``) passed since the saved version ``saved`` (None:
    not known: save). Otherwise a restart replays the rounds since ``saved`` from their
    kept deltas (:mod:`coordinator.storage.replay`), at most ``every`` - 1 of them.
    """
    if saved is None:
        return SnapshotDecision(True, "no saved working state known")
    if snapshot:
        return SnapshotDecision(True, "saved with the snapshot")
    if last:
        return SnapshotDecision(True, "the job's last round")
    since = version - saved
    if since >= every:
        return SnapshotDecision(True, f"{since} round(s) since the state saved at {saved}")
    return SnapshotDecision(
        False, f"{since} round(s) since the state saved at {saved}, below {every}"
    )


def next_snapshot_round(version: int, last_round: int | None, plan: SnapshotPlan) -> int:
    """The version the next snapshot is planned for, as the job stands at θ_version."""
    every = plan.every_rounds
    if plan.mode == "fixed":
        return (version // every + 1) * every
    if last_round is None:
        return version + 1
    return max(last_round + every, version + 1)


def snapshot_status(
    plan: SnapshotPlan, version: int, last_round: int | None, risk: Risk | None = None
) -> dict[str, Any]:
    """The ``snapshot`` object of the job's status (``risk``: the job's hardware risk)."""
    return {
        "risk": None if risk is None else {"score": risk.score, "reason": risk.reason},
        "mode": plan.mode,
        "every_rounds": plan.every_rounds,
        "tau_s": plan.tau_s,
        "reason": plan.reason,
        "last_round": last_round,
        "next_round": next_snapshot_round(version, last_round, plan),
        "cost_s": plan.cost_s,
        "mtbf_s": plan.mtbf_s,
    }


def load_stats(path: Path) -> SnapshotStats:
    """The stats saved at ``path``; fresh ones if there are none or they are unreadable
    (they are measured again). Blocking."""
    try:
        return SnapshotStats.from_json(json.loads(path.read_bytes()))
    except FileNotFoundError:
        return SnapshotStats()
    except (OSError, ValueError) as exc:
        log.warning("snapshot measurements %s unreadable, measuring afresh: %s", path, exc)
        return SnapshotStats()


def save_stats(path: Path, stats: SnapshotStats) -> None:
    """Write ``stats`` to ``path`` atomically. Blocking."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps(stats.to_json(), sort_keys=True).encode())
