"""The usage report (``GET /v1/usage``, ``geofed usage``): the stored jobs and the whole
audit log read, folded and priced (:mod:`.usage_facts`, :mod:`.showback`) off the loop."""

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
from coordinator.executors import Executors
from coordinator.jobs.spec import JobSpec, JobSpecError, parse_stored_spec
from coordinator.rounds.records import JobState
from coordinator.state.async_store import AsyncStore
from coordinator.state.audit import AuditEntry
from coordinator.state.store import JobRecord

__all__ = ["PAGE", "UsageReport", "cost_facts", "usage_report"]

#: Audit entries read per page.
PAGE = 1000


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


async def usage_report(
    db: AsyncStore,
    executors: Executors,
    prices: PriceTable | None,
    period: Period,
    job: str | None = None,
) -> UsageReport:
    """The report of ``period`` (one job's, or every job's), priced by ``prices`` (None:
    none configured, so nothing is priced)."""
    records = [r for r in await db.list_jobs() if job is None or r.job_id == job]
    entries: list[AuditEntry] = []
    after = 0
    while page := await db.audit_entries(after, PAGE, job):
        entries.extend(page)
        after = page[-1].seq
    table = prices if prices is not None else PriceTable()
    costs = await executors.compute(_price, records, entries, table, period)
    return UsageReport(period, table.currency, prices is not None, costs, team_costs(costs))


def _price(
    records: Sequence[JobRecord],
    entries: Sequence[AuditEntry],
    prices: PriceTable,
    period: Period,
) -> list[JobCost]:
    specs: dict[str, JobSpec] = {}
    for record in records:
        try:
            specs[record.job_id] = parse_stored_spec(record.spec)
        except JobSpecError:
            continue  # a spec this version cannot read: the job cannot run either
    fold = UsageFold({name: spec.region_names for name, spec in specs.items()})
    fold.fold(entries)
    for record in records:
        if JobState(record.state).final:
            fold.ended(record.job_id, record.updated_at)
    costs = []
    for name, spec in specs.items():
        usage = fold.jobs.get(name)
        if usage is None:
            continue
        costs.append(job_cost(usage, cost_facts(spec, usage), prices, period))
    return sorted_costs(costs)


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
