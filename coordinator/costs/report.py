"""The usage report (``GET /v1/usage``, ``geofed usage``): the stored jobs and the audit
log folded (:mod:`.usage_facts`) into a :class:`UsageLedger`, priced over a period
(:mod:`.showback`). Pure; :mod:`.watch` feeds it and runs it off the loop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.costs.prices import PriceTable
from coordinator.costs.showback import (
    CostFacts,
    JobCost,
    Period,
    TeamCost,
    job_cost,
    sorted_costs,
    team_costs,
)
from coordinator.costs.usage_facts import JobUsage, UsageFold
from coordinator.jobs.spec import JobSpec, JobSpecError, parse_stored_spec
from coordinator.rounds.records import JobState
from coordinator.state.audit import AuditEntry
from coordinator.state.store import JobRecord

__all__ = [
    "UsageLedger",
    "UsageReport",
    "cost_facts",
    "cost_json",
    "expected_cost",
    "projected_total",
]


@dataclass(frozen=True)
class UsageReport:
    """Every job's cost over a period, and each team's."""

    period: Period
    currency: str
    priced: bool
    jobs: Sequence[JobCost]
    teams: Sequence[TeamCost]

    def to_json(self) -> dict[str, Any]:
        return {
            "since": self.period.since,
            "until": self.period.until,
            "currency": self.currency,
            "priced": self.priced,
            "jobs": [_job_json(cost) for cost in self.jobs],
            "teams": [
                {
                    "team": team.team,
                    "jobs": team.jobs,
                    "gpu_hours": team.gpu_hours,
                    "wan_gb": team.wan_gb,
                    "storage_gb_months": team.storage_gb_months,
                    "tokens": team.tokens,
                    "total": team.total,
                    "unpriced": team.unpriced,
                }
                for team in self.teams
            ],
        }


def _job_json(cost: JobCost) -> dict[str, Any]:
    return {
        "job": cost.job,
        "team": cost.team,
        "gpu_hours": cost.gpu_hours,
        "gpu_cost": cost.gpu_cost,
        "upload_gb": cost.upload_gb,
        "upload_cost": cost.upload_cost,
        "download_gb": cost.download_gb,
        "download_cost": cost.download_cost,
        "storage_gb_months": cost.storage_gb_months,
        "storage_cost": cost.storage_cost,
        "tokens": cost.tokens,
        "rounds": cost.rounds,
        "total": cost.total,
        "per_million_tokens": cost.per_million_tokens,
        "per_round": cost.per_round,
        "unpriced": list(cost.unpriced),
    }


def projected_total(cost: JobCost, rounds: int | None) -> float | None:
    """What all ``rounds`` of a job would cost at its cost per round so far (None while
    part of it is unpriced, no round is published, or ``rounds`` is None: a job that
    ended)."""
    per_round = cost.per_round
    return None if per_round is None or rounds is None else per_round * rounds


def expected_cost(cost: JobCost, rounds: int, *, ended: bool) -> float | None:
    """What a job is expected to cost in all: while it runs, its projection to all its
    ``rounds``; once it ended, what it cost (None while part of it is unpriced)."""
    if ended:
        return None if cost.unpriced else cost.total
    return projected_total(cost, rounds)


def cost_json(cost: JobCost, currency: str, rounds: int | None) -> dict[str, Any]:
    """A job's cost since it started as its status shows it, with its projection to all
    its ``rounds`` at the cost per round so far (None while part of it is unpriced, no
    round is published, or ``rounds`` is None: a job that ended)."""
    return {
        "currency": currency,
        "total": cost.total,
        "gpu": cost.gpu_cost,
        "wan": cost.upload_cost + cost.download_cost,
        "storage": cost.storage_cost,
        "per_million_tokens": cost.per_million_tokens,
        "projected_total": projected_total(cost, rounds),
        "unpriced": list(cost.unpriced),
    }


class UsageLedger:
    """The jobs' specs and their usage folded from the audit log so far (pure; whoever
    owns it lets one caller at a time use it: :class:`coordinator.costs.watch.CostWatch`)."""

    def __init__(self) -> None:
        self.specs: dict[str, JobSpec] = {}
        self._regions: dict[str, tuple[str, ...]] = {}
        self.fold = UsageFold(self._regions)
        #: The last audit entry folded.
        self.seq = 0

    def add(self, records: Sequence[JobRecord], entries: Sequence[AuditEntry]) -> None:
        """Learn the jobs of ``records`` and fold ``entries`` (the next after :attr:`seq`)."""
        for record in records:
            if record.job_id not in self.specs:
                try:
                    spec = parse_stored_spec(record.spec)
                except JobSpecError:
                    continue  # a spec this version cannot read: the job cannot run either
                self.specs[record.job_id] = spec
                self._regions[record.job_id] = spec.region_names
        self.fold.fold(entries)
        if entries:
            self.seq = entries[-1].seq
        for record in records:
            if JobState(record.state).final:
                self.fold.ended(record.job_id, record.updated_at)

    def costs(self, prices: PriceTable, period: Period, job: str | None = None) -> list[JobCost]:
        """The cost over ``period`` of each job (or ``job``) that used anything in it, by
        team then job."""
        costs = []
        for name, spec in self.specs.items():
            usage = self.fold.jobs.get(name)
            if usage is None or job not in (None, name):
                continue
            cost = job_cost(usage, cost_facts(spec, usage), prices, period)
            if cost.used:
                costs.append(cost)
        return sorted_costs(costs)

    def knows(self, job: str) -> bool:
        """Whether ``job`` is a stored job this ledger has read."""
        return job in self.specs

    def report(self, prices: PriceTable | None, period: Period, job: str | None) -> UsageReport:
        """The report of ``period`` priced by ``prices`` (None: nothing is priced)."""
        table = prices if prices is not None else PriceTable()
        costs = self.costs(table, period, job)
        return UsageReport(period, table.currency, prices is not None, costs, team_costs(costs))


def cost_facts(spec: JobSpec, usage: JobUsage) -> CostFacts:
    """What ``spec`` says the costs of ``usage`` depend on: its team, and the GPUs its
    needs state in each region it named or that joined it later."""
    regions = {*spec.region_names, *(r for span in usage.all_spans() for r in span.regions)}
    gpus: dict[str, tuple[int, str | None]] = {}
    for region in sorted(regions):
        need = spec.need_in(region)
        if need is not None and need.gpus:
            gpus[region] = (need.gpus, need.gpu_kind)
    return CostFacts(spec.job, spec.team_name, gpus)
