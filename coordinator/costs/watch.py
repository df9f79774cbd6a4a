"""The coordinator's view of what jobs cost: the audit log folded as it grows.

:class:`CostWatch` keeps one :class:`~coordinator.costs.report.UsageLedger` for the
process. Each use reads the audit entries after the last it folded, at most
:data:`PAGES_PER_CATCH_UP` pages a step, and folds and prices them in a worker thread
that a cancelled caller waits for (so the ledger is never left half-updated), one caller
at a time. It answers ``GET /v1/usage`` (:meth:`CostWatch.report`: caught up to the log's
head first) and, at each scrape, sets when the coordinator has a price table
(:meth:`CostWatch.refresh`):

- ``geofed_job_cost{job, team, kind}``: what a job cost since it started, by ``kind``
  (``gpu``, ``upload``, ``download``, ``storage``);
- ``geofed_job_budget{job, team}``, while a job whose spec states a budget runs, with
  ``geofed_job_projected_cost{job, team}``: what all its rounds would cost at its cost
  per round so far (both gone once it ended: ``geofed usage`` tells what it cost);
- ``geofed_team_cost{team}``: what a team's jobs cost over its budget's window (30 days
  without a budget), with ``geofed_team_budget{team}`` where the scheduling file states one;
- ``geofed_team_budget_burn_rate{team}``: its spend over the last 6 hours against what its
  budget allows in that time (1: on course to spend exactly the budget).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, TypeVar

from coordinator.costs.prices import PriceTable
from coordinator.costs.report import UsageLedger, UsageReport, projected_total
from coordinator.costs.showback import JobCost, Period, burn_rate
from coordinator.errors import NotFound
from coordinator.rounds.records import JobState
from coordinator.scheduling.config import TeamQuota
from coordinator.services import Services
from coordinator.state.audit import MAX_PAGE, AuditEntry
from coordinator.state.store import JobRecord

__all__ = [
    "BURN_WINDOW_S",
    "DEFAULT_WINDOW_S",
    "FRESH_S",
    "PAGES_PER_CATCH_UP",
    "CostFigures",
    "CostWatch",
    "TeamFigures",
    "job_budgets",
]

#: The recent spend a burn rate is measured over.
BURN_WINDOW_S: Final = 6 * 3600.0
#: The window of a team's cost without a budget of its own.
DEFAULT_WINDOW_S: Final = 30 * 86400.0
#: Audit pages (of :data:`~coordinator.state.audit.MAX_PAGE` entries) one step folds at most.
PAGES_PER_CATCH_UP: Final = 20
#: Figures younger than this are reused while the audit log has not grown: the status
#: page, job statuses and scrapes asking together cost one refresh.
FRESH_S: Final = 2.0

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TeamFigures:
    """A team's cost over its window, its budget and burn rate (None without a budget)."""

    cost: float
    budget: float | None
    burn_rate: float | None


@dataclass(frozen=True, slots=True)
class CostFigures:
    """What one refresh found: each job's cost since it started, each team's."""

    jobs: Sequence[JobCost]
    teams: Mapping[str, TeamFigures]
    #: Running job -> (team, its spec's budget, the projection of its cost or None).
    budgets: Mapping[str, tuple[str, float, float | None]] = field(default_factory=dict)


class CostWatch:
    """See the module docstring."""

    def __init__(self, services: Services, teams: Callable[[], Mapping[str, TeamQuota]]) -> None:
        self._s = services
        self._teams = teams
        self._ledger = UsageLedger()
        self._lock = asyncio.Lock()
        #: Each job's cost since it started, as the last refresh found it.
        self.latest: dict[str, JobCost] = {}
        self._figures: CostFigures | None = None
        self._at = 0.0
        self._budgets: set[tuple[str, str]] = set()
        self._projected: set[tuple[str, str]] = set()

    async def refresh(self) -> CostFigures | None:
        """Fold up to :data:`PAGES_PER_CATCH_UP` pages of new entries and set the gauges
        as of now; None (and nothing set) without a price table."""
        prices = self._s.config.prices
        if prices is None:
            return None
        async with self._lock:
            # Callers that queued behind a refresh take its figures, unless the log grew
            # since: no work piles up, and nothing recorded is missed.
            head, _ = await self._s.db.audit_head()
            fresh = time.monotonic() - self._at < FRESH_S and head == self._ledger.seq
            if self._figures is not None and fresh:
                return self._figures
            records, entries = await self._read(PAGES_PER_CATCH_UP)
            figures = await self._in_thread(
                _refresh, self._ledger, records, entries, prices, self._teams(), self._s.clock()
            )
            self._figures, self._at = figures, time.monotonic()
        self.latest = {cost.job: cost for cost in figures.jobs}
        self._show(figures)
        return figures

    @property
    def currency(self) -> str:
        """The price table's currency ('' without one)."""
        prices = self._s.config.prices
        return prices.currency if prices is not None else ""

    async def report(self, period: Period, job: str | None) -> UsageReport:
        """The usage report of ``period``, with every audit entry up to now folded;
        :class:`NotFound` for a ``job`` the coordinator does not have."""
        async with self._lock:
            while True:
                records, entries = await self._read(PAGES_PER_CATCH_UP)
                await self._in_thread(self._ledger.add, records, entries)
                if len(entries) < PAGES_PER_CATCH_UP * MAX_PAGE:
                    break
            if job is not None and not self._ledger.knows(job):
                raise NotFound(f"no job {job!r}")
            return await self._in_thread(self._ledger.report, self._s.config.prices, period, job)

    async def _read(self, pages: int) -> tuple[list[JobRecord], list[AuditEntry]]:
        records = await self._s.db.list_jobs()
        entries: list[AuditEntry] = []
        after = self._ledger.seq
        for _ in range(pages):
            page = await self._s.db.audit_entries(after, MAX_PAGE)
            entries.extend(page)
            if len(page) < MAX_PAGE:
                break
            after = page[-1].seq
        return records, entries

    async def _in_thread(self, function: Callable[..., T], *args: object) -> T:
        """``function`` in the compute pool; a cancelled caller waits for it to end (the
        ledger is then whole, and the lock is not given up while the thread changes it)."""
        running = asyncio.ensure_future(self._s.executors.compute(function, *args))
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            await asyncio.wait([running])
            raise

    def _show(self, figures: CostFigures) -> None:
        metrics = self._s.metrics
        for cost in figures.jobs:
            for kind, value in (
                ("gpu", cost.gpu_cost),
                ("upload", cost.upload_cost),
                ("download", cost.download_cost),
                ("storage", cost.storage_cost),
            ):
                metrics.job_cost.labels(job=cost.job, team=cost.team, kind=kind).set(value)
        budgets: set[tuple[str, str]] = set()
        projected: set[tuple[str, str]] = set()
        for job, (team, budget, projection) in figures.budgets.items():
            metrics.job_budget.labels(job=job, team=team).set(budget)
            budgets.add((job, team))
            if projection is not None:
                metrics.job_projected_cost.labels(job=job, team=team).set(projection)
                projected.add((job, team))
        # A job that ended is no longer watched against its budget: its alerts clear.
        for job, team in self._budgets - budgets:
            metrics.job_budget.remove(job, team)
        for job, team in self._projected - projected:
            metrics.job_projected_cost.remove(job, team)
        self._budgets, self._projected = budgets, projected
        for team, shown in figures.teams.items():
            metrics.team_cost.labels(team=team).set(shown.cost)
            if shown.budget is not None:
                metrics.team_budget.labels(team=team).set(shown.budget)
            if shown.burn_rate is not None:
                metrics.team_budget_burn_rate.labels(team=team).set(shown.burn_rate)


def _refresh(
    ledger: UsageLedger,
    records: Sequence[JobRecord],
    entries: Sequence[AuditEntry],
    prices: PriceTable,
    teams: Mapping[str, TeamQuota],
    now: float,
) -> CostFigures:
    """Fold ``entries`` into ``ledger`` and price every job (in a worker thread)."""
    ledger.add(records, entries)
    jobs = ledger.costs(prices, Period(0.0, now))
    budgets = {name: quota.budget for name, quota in teams.items() if quota.budget is not None}
    # Each team's cost over its own window: one pricing per distinct window.
    windows = {
        team: budgets[team].window_s if team in budgets else DEFAULT_WINDOW_S
        for team in {*budgets, *(cost.team for cost in jobs)}
    }
    priced = {
        window: ledger.costs(prices, Period(now - window, now))
        for window in {*windows.values(), BURN_WINDOW_S}
    }
    shown: dict[str, TeamFigures] = {}
    for team, window in windows.items():
        cost = sum(c.total for c in priced[window] if c.team == team)
        budget = budgets.get(team)
        if budget is None:
            shown[team] = TeamFigures(cost, None, None)
            continue
        recent = sum(c.total for c in priced[BURN_WINDOW_S] if c.team == team)
        rate = burn_rate(recent, BURN_WINDOW_S, budget.amount, budget.window_s)
        shown[team] = TeamFigures(cost, budget.amount, rate)
    return CostFigures(jobs, shown, job_budgets(ledger, records, jobs))


def job_budgets(
    ledger: UsageLedger, records: Sequence[JobRecord], jobs: Sequence[JobCost]
) -> dict[str, tuple[str, float, float | None]]:
    """Each running priced job with a budget: its team, budget and projection."""
    running = {r.job_id for r in records if not JobState(r.state).final}
    found: dict[str, tuple[str, float, float | None]] = {}
    for job in jobs:
        spec = ledger.specs[job.job]
        if spec.budget is not None and job.job in running:
            found[job.job] = (job.team, spec.budget, projected_total(job, spec.rounds))
    return found
