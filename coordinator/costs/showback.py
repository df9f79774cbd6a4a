"""What each job and team cost over a period (pure: usage facts and prices in, costs out).

- **GPU**: the GPUs a job's needs state in a region (``needs``/``region_needs``), for as
  long as it held them there (:class:`~coordinator.costs.usage_facts.Span`), at the
  region's price for that GPU kind in its market. A job that states no GPUs counts none.
- **WAN**: each delta a region sent, at the region's price to the coordinator; each update
  or snapshot the coordinator sent to a region, at the coordinator's price to it.
- **Storage**: each checkpoint of the job's chain, for the part of the period it was
  stored, at its location's price per GB-month.

A GB is 10^9 bytes and a month 730 hours, as clouds bill them. What the price table
does not price is counted (hours, GB) but left out of the cost, and named in
``unpriced``; a report never prices it at zero silently.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from coordinator.costs.prices import PriceTable
from coordinator.costs.usage_facts import JobUsage

__all__ = [
    "GB",
    "MONTH_S",
    "CostFacts",
    "JobCost",
    "Period",
    "TeamCost",
    "burn_rate",
    "job_cost",
    "sorted_costs",
    "team_costs",
]

GB: Final = 1e9
MONTH_S: Final = 730 * 3600.0


@dataclass(frozen=True, slots=True)
class Period:
    """From ``since`` (included) to ``until`` (excluded), epoch seconds."""

    since: float
    until: float

    def overlap(self, start: float, end: float | None) -> float:
        """Seconds of [start, end) (end None: open) within the period."""
        stop = self.until if end is None else min(end, self.until)
        return max(0.0, stop - max(start, self.since))

    def holds(self, at: float) -> bool:
        return self.since <= at < self.until


@dataclass(frozen=True, slots=True)
class CostFacts:
    """What the job's spec says that costs depend on."""

    job: str
    team: str
    #: region -> (GPUs the job needs there, their kind or None).
    gpus: Mapping[str, tuple[int, str | None]]


@dataclass(slots=True)
class _Part:
    """One kind of use: how much, and what the priced part of it cost."""

    quantity: float = 0.0
    cost: float = 0.0


@dataclass(frozen=True, slots=True)
class JobCost:
    """A job's use and cost over a period; costs leave out what ``unpriced`` names."""

    job: str
    team: str
    gpu_hours: float
    gpu_cost: float
    upload_gb: float
    upload_cost: float
    download_gb: float
    download_cost: float
    storage_gb_months: float
    storage_cost: float
    tokens: int
    rounds: int
    unpriced: tuple[str, ...]

    @property
    def total(self) -> float:
        return self.gpu_cost + self.upload_cost + self.download_cost + self.storage_cost

    @property
    def per_million_tokens(self) -> float | None:
        """None without tokens, or while part of the use is unpriced (the total is then
        only what was priced)."""
        if not self.tokens or self.unpriced:
            return None
        return self.total / self.tokens * 1e6

    @property
    def per_round(self) -> float | None:
        if not self.rounds or self.unpriced:
            return None
        return self.total / self.rounds

    @property
    def used(self) -> bool:
        """Whether the job used anything in the period."""
        return any(
            (self.gpu_hours, self.upload_gb, self.download_gb, self.storage_gb_months,
             self.tokens, self.rounds)
        )  # fmt: skip


@dataclass(slots=True)
class TeamCost:
    """A team's jobs, summed."""

    team: str
    jobs: int = 0
    gpu_hours: float = 0.0
    wan_gb: float = 0.0
    storage_gb_months: float = 0.0
    tokens: int = 0
    total: float = 0.0
    unpriced: list[str] = field(default_factory=list)


def job_cost(usage: JobUsage, facts: CostFacts, prices: PriceTable, period: Period) -> JobCost:
    """``usage`` over ``period``, priced (see the module docstring)."""
    unpriced: dict[str, None] = {}
    gpu = _gpu(usage, facts, prices, period, unpriced)
    upload, download = _Part(), _Part()
    tokens = 0
    for sent in usage.uploads:
        if period.holds(sent.at):
            tokens += sent.tokens
            _add(upload, sent.size / GB, prices.upload_per_gb(sent.region),
                 f"WAN from {sent.region}", unpriced)  # fmt: skip
    for fetched in usage.downloads:
        if period.holds(fetched.at):
            _add(download, fetched.size / GB, prices.download_per_gb(fetched.region),
                 f"WAN to {fetched.region}", unpriced)  # fmt: skip
    storage = _Part()
    for stored in usage.stored.values():
        seconds = period.overlap(stored.since, stored.until)
        if seconds > 0:
            _add(storage, stored.size / GB * seconds / MONTH_S,
                 prices.storage_per_gb_month(stored.location),
                 f"storage {stored.location}", unpriced)  # fmt: skip
    unsized = sum(1 for at in usage.unsized if period.holds(at))
    if unsized:
        unpriced[f"{unsized} audit entries without sizes (older version)"] = None
    return JobCost(
        job=facts.job,
        team=facts.team,
        gpu_hours=gpu.quantity,
        gpu_cost=gpu.cost,
        upload_gb=upload.quantity,
        upload_cost=upload.cost,
        download_gb=download.quantity,
        download_cost=download.cost,
        storage_gb_months=storage.quantity,
        storage_cost=storage.cost,
        tokens=tokens,
        rounds=sum(1 for at in usage.published if period.holds(at)),
        unpriced=tuple(unpriced),
    )


def _gpu(
    usage: JobUsage,
    facts: CostFacts,
    prices: PriceTable,
    period: Period,
    unpriced: dict[str, None],
) -> _Part:
    part = _Part()
    for span in usage.all_spans():
        seconds = period.overlap(span.start, span.end)
        if seconds <= 0:
            continue
        for region in span.regions:
            gpus, kind = facts.gpus.get(region, (0, None))
            if gpus:
                _add(part, gpus * seconds / 3600, prices.gpu_hour(region, kind),
                     f"GPU-hours in {region} ({kind or 'any kind'})", unpriced)  # fmt: skip
    return part


def _add(
    part: _Part, quantity: float, price: float | None, what: str, unpriced: dict[str, None]
) -> None:
    part.quantity += quantity
    if price is None:
        unpriced[what] = None
    else:
        part.cost += quantity * price


def burn_rate(recent_cost: float, recent_s: float, budget: float, window_s: float) -> float:
    """How fast ``recent_cost`` (spent over the last ``recent_s`` seconds) spends a budget
    of ``budget`` per ``window_s``: 1 spends exactly the budget over the window, 2 spends
    it in half the window."""
    return (recent_cost / recent_s) / (budget / window_s)


def team_costs(costs: Iterable[JobCost]) -> list[TeamCost]:
    """The jobs' costs summed per team, by team name."""
    teams: dict[str, TeamCost] = {}
    for cost in costs:
        team = teams.setdefault(cost.team, TeamCost(cost.team))
        team.jobs += 1
        team.gpu_hours += cost.gpu_hours
        team.wan_gb += cost.upload_gb + cost.download_gb
        team.storage_gb_months += cost.storage_gb_months
        team.tokens += cost.tokens
        team.total += cost.total
        team.unpriced.extend(f"{cost.job}: {what}" for what in cost.unpriced)
    return [teams[name] for name in sorted(teams)]


def sorted_costs(costs: Sequence[JobCost]) -> list[JobCost]:
    """By team, then job."""
    return sorted(costs, key=lambda cost: (cost.team, cost.job))
