"""The cost gauges: the audit log folded as it grows, priced at each scrape.

:class:`CostWatch` keeps one :class:`~coordinator.costs.usage_facts.UsageFold` for the
process and reads only the audit entries after the last it folded, so a scrape costs the
entries since the one before plus pricing each job (:mod:`.showback`, in a worker thread).
It sets, when the coordinator has a price table:

- ``geofed_job_cost{job, team, kind}``: what a job cost since it started, by ``kind``
  (``gpu``, ``upload``, ``download``, ``storage``);
- ``geofed_team_cost{team}``: what a team's jobs cost over its budget's window (30 days
  without a budget), with ``geofed_team_budget{team}`` where the scheduling file states one;
- ``geofed_team_budget_burn_rate{team}``: its spend over the last 6 hours as a share of
  what its budget allows in that time (1: on course to spend exactly the budget).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from coordinator.costs.prices import PriceTable
from coordinator.costs.report import PAGE, cost_facts
from coordinator.costs.showback import JobCost, Period, burn_rate, job_cost
from coordinator.costs.usage_facts import UsageFold
from coordinator.jobs.spec import JobSpec, JobSpecError, parse_stored_spec
from coordinator.metrics import CoordinatorMetrics
from coordinator.rounds.records import JobState
from coordinator.scheduling.config import TeamQuota
from coordinator.services import Services
from coordinator.state.audit import AuditEntry
from coordinator.state.store import JobRecord

__all__ = ["BURN_WINDOW_S", "DEFAULT_WINDOW_S", "CostFigures", "CostWatch"]

log = logging.getLogger(__name__)

#: The recent spend a burn rate is measured over.
BURN_WINDOW_S: Final = 6 * 3600.0
#: The window of a team's cost without a budget of its own.
DEFAULT_WINDOW_S: Final = 30 * 86400.0


@dataclass(frozen=True, slots=True)
class TeamFigures:
    cost: float
    budget: float | None
    burn_rate: float | None


@dataclass(frozen=True, slots=True)
class CostFigures:
    """What one refresh found: each job's cost since it started, each team's."""

    jobs: Sequence[JobCost]
    teams: Mapping[str, TeamFigures]


@dataclass
class _State:
    regions: dict[str, tuple[str, ...]] = field(default_factory=dict)
    fold: UsageFold | None = None
    specs: dict[str, JobSpec] = field(default_factory=dict)
    seq: int = 0


class CostWatch:
    """Keeps the cost gauges current (see the module docstring)."""

    def __init__(self, services: Services, teams: Callable[[], Mapping[str, TeamQuota]]) -> None:
        self._s = services
        self._teams = teams
        self._state = _State()
        self._state.fold = UsageFold(self._state.regions)
        self._lock = asyncio.Lock()

    async def refresh(self) -> CostFigures | None:
        """Fold the new audit entries and set the gauges as of now; None without prices."""
        prices = self._s.config.prices
        if prices is None:
            return None
        async with self._lock:
            records = await self._s.db.list_jobs()
            entries: list[AuditEntry] = []
            while page := await self._s.db.audit_entries(self._state.seq, PAGE):
                entries.extend(page)
                self._state.seq = page[-1].seq
            figures = await self._s.executors.compute(
                _refresh, self._state, records, entries, prices, self._teams(), self._s.clock()
            )
        self._show(figures)
        return figures

    def _show(self, figures: CostFigures) -> None:
        metrics: CoordinatorMetrics = self._s.metrics
        for cost in figures.jobs:
            for kind, value in (
                ("gpu", cost.gpu_cost),
                ("upload", cost.upload_cost),
                ("download", cost.download_cost),
                ("storage", cost.storage_cost),
            ):
                metrics.job_cost.labels(job=cost.job, team=cost.team, kind=kind).set(value)
        for team, shown in figures.teams.items():
            metrics.team_cost.labels(team=team).set(shown.cost)
            if shown.budget is not None:
                metrics.team_budget.labels(team=team).set(shown.budget)
            if shown.burn_rate is not None:
                metrics.team_budget_burn_rate.labels(team=team).set(shown.burn_rate)


def _refresh(
    state: _State,
    records: Sequence[JobRecord],
    entries: Sequence[AuditEntry],
    prices: PriceTable,
    teams: Mapping[str, TeamQuota],
    now: float,
) -> CostFigures:
    """Fold ``entries`` into ``state`` and price every job (in a worker thread)."""
    for record in records:
        if record.job_id not in state.specs:
            try:
                spec = parse_stored_spec(record.spec)
            except JobSpecError:
                continue
            state.specs[record.job_id] = spec
            state.regions[record.job_id] = spec.region_names
    fold = state.fold
    assert fold is not None
    fold.fold(entries)
    for record in records:
        if JobState(record.state).final:
            fold.ended(record.job_id, record.updated_at)
    since_start = Period(0.0, now)
    jobs: list[JobCost] = []
    windowed: dict[str, list[float]] = {}
    for name, spec in state.specs.items():
        usage = fold.jobs.get(name)
        if usage is None:
            continue
        facts = cost_facts(spec, usage)
        jobs.append(job_cost(usage, facts, prices, since_start))
        budget = teams.get(facts.team, TeamQuota()).budget
        window = budget.window_s if budget is not None else DEFAULT_WINDOW_S
        sums = windowed.setdefault(facts.team, [0.0, 0.0])
        sums[0] += job_cost(usage, facts, prices, Period(now - window, now)).total
        sums[1] += job_cost(usage, facts, prices, Period(now - BURN_WINDOW_S, now)).total
    # A team with a budget always has its series, so that its alerts see 0, not nothing.
    for name, quota in teams.items():
        if quota.budget is not None:
            windowed.setdefault(name, [0.0, 0.0])
    shown: dict[str, TeamFigures] = {}
    for name, (cost, recent) in windowed.items():
        budgeted = teams.get(name, TeamQuota()).budget
        if budgeted is None:
            shown[name] = TeamFigures(cost, None, None)
        else:
            rate = burn_rate(recent, BURN_WINDOW_S, budgeted.amount, budgeted.window_s)
            shown[name] = TeamFigures(cost, budgeted.amount, rate)
    return CostFigures(jobs, shown)
