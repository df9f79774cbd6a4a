"""Usage and cost: the price table, the audit log folded into usage, and showback against
figures computed by hand."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from coordinator.api.admin import refresh_costs
from coordinator.api.usage import period_query
from coordinator.config import ConfigError, parse_config
from coordinator.costs.prices import PriceTable
from coordinator.costs.report import UsageLedger, cost_json, expected_cost
from coordinator.costs.showback import MONTH_S, CostFacts, Period, burn_rate, job_cost, team_costs
from coordinator.costs.usage_facts import UsageFold
from coordinator.costs.watch import job_budgets
from coordinator.errors import BadRequest
from coordinator.jobs.spec import parse_job_spec
from coordinator.state.audit import AuditEntry
from coordinator.state.store import JobRecord
from tests.support.audit_entries import audit_entry
from tests.support.configs import MINIMAL_COORDINATOR
from tests.support.coordinator import job_yaml

PRICES = PriceTable.model_validate(
    {
        "currency": "EUR",
        "regions": {
            "eu-west": {
                "gpu_hour": {
                    "H100": {"on_demand": 4.0, "spot": 1.5},
                    "default": {"on_demand": 3.0},
                },
                "egress_per_gb": {"coordinator": 0.05},
            },
            "us-east": {
                "market": "spot",
                "gpu_hour": {"default": {"on_demand": 2.0, "spot": 1.0}},
                "egress_per_gb": {"default": 0.1},
            },
        },
        "coordinator": {"egress_per_gb": {"eu-west": 0.0, "default": 0.08}},
        "storage": {"archive": {"per_gb_month": 0.02}},
    }
)
LLM = CostFacts("llm", "nlp", {"eu-west": (4, "H100"), "us-east": (2, None)})


def entry(
    at: float,
    what: str,
    job: str = "llm",
    *,
    verdict: str = "ok",
    round_: int | None = None,
    region: str | None = None,
    **details: Any,
) -> AuditEntry:
    return audit_entry(at, what, job, verdict=verdict, round_=round_, region=region, **details)


def llm_log() -> list[AuditEntry]:
    """Admitted in both regions at 1000, one round, preempted at 8200 (2 hours); admitted
    again in eu-west alone at 9000, cancelled at 12600 (1 hour)."""
    return [
        entry(1000, "job.admit", to="running", regions=["eu-west", "us-east"]),
        entry(
            4600, "delta.accept", round_=0, region="eu-west", size=2_000_000_000, tokens=1_000_000
        ),
        entry(4650, "delta.accept", round_=0, region="us-east", size=1_000_000_000, tokens=500_000),
        # The same delta accepted again (a retried commit) counts once.
        entry(4660, "delta.accept", round_=0, region="us-east", size=1_000_000_000, tokens=500_000),
        entry(
            4700,
            "round.publish",
            round_=0,
            included=["eu-west", "us-east"],
            update_size=500_000_000,
            snapshot_size=4_000_000_000,
            location="archive",
        ),
        # Each region fetches the update; a refused fetch sends nothing.
        entry(
            4710,
            "policy.global_update",
            verdict="allow",
            round_=0,
            region="eu-west",
            artifact="update",
            size=500_000_000,
        ),
        entry(
            4720,
            "policy.global_update",
            verdict="allow",
            round_=0,
            region="us-east",
            artifact="update",
            size=500_000_000,
        ),
        entry(
            4730,
            "policy.global_update",
            verdict="deny",
            round_=0,
            region="ap-south",
            artifact="update",
            size=500_000_000,
        ),
        entry(8200, "job.preempt"),
        entry(9000, "job.admit", to="running", regions=["eu-west"]),
        entry(12600, "job.cancel"),
    ]


def folded(
    entries: list[AuditEntry], regions: dict[str, tuple[str, ...]] | None = None
) -> UsageFold:
    fold = UsageFold(regions or {"llm": ("eu-west", "us-east")})
    fold.fold(entries)
    return fold


def test_a_job_is_priced_as_computed_by_hand() -> None:
    until = 4700 + MONTH_S  # the checkpoints are stored a whole month of the period
    cost = job_cost(folded(llm_log()).jobs["llm"], LLM, PRICES, Period(0, until))
    # GPUs: 2 h x (4 H100 in eu-west at 4.0 + 2 in us-east at its spot 1.0) + 1 h x 4 x 4.0.
    assert cost.gpu_hours == pytest.approx(2 * (4 + 2) + 4)
    assert cost.gpu_cost == pytest.approx(2 * (4 * 4.0 + 2 * 1.0) + 4 * 4.0)
    # WAN: 2 GB from eu-west at 0.05 and 1 GB from us-east at 0.1; the 0.5 GB update to
    # each region: free to eu-west, 0.08 to us-east.
    assert (cost.upload_gb, cost.upload_cost) == pytest.approx((3.0, 2 * 0.05 + 0.1))
    assert (cost.download_gb, cost.download_cost) == pytest.approx((1.0, 0.5 * 0.08))
    # Storage: the update (0.5 GB) and the snapshot (4 GB) for one month at 0.02.
    assert (cost.storage_gb_months, cost.storage_cost) == pytest.approx((4.5, 4.5 * 0.02))
    assert cost.total == pytest.approx(52.0 + 0.2 + 0.04 + 0.09)
    assert (cost.tokens, cost.rounds) == (1_500_000, 1)
    assert cost.per_million_tokens == pytest.approx(cost.total / 1.5)
    assert cost.per_round == pytest.approx(cost.total)
    assert cost.unpriced == ()


def test_a_period_counts_only_what_falls_within_it() -> None:
    cost = job_cost(folded(llm_log()).jobs["llm"], LLM, PRICES, Period(5000, 5000 + 1800))
    assert cost.gpu_hours == pytest.approx(0.5 * (4 + 2))
    assert (cost.upload_gb, cost.download_gb, cost.tokens, cost.rounds) == (0, 0, 0, 0)
    assert cost.storage_gb_months == pytest.approx(4.5 * 1800 / MONTH_S)


def test_what_the_table_does_not_price_is_counted_and_named_not_free() -> None:
    facts = CostFacts("vit", "vision", {"ap-south": (1, "A100")})
    log = [
        entry(0, "job.admit", "vit", verdict="allow"),  # admitted at once: all its regions
        entry(100, "delta.accept", "vit", round_=0, region="ap-south", size=10**9, tokens=7),
    ]
    usage = folded(log, {"vit": ("ap-south",)}).jobs["vit"]
    cost = job_cost(usage, facts, PRICES, Period(0, 7200))
    assert cost.gpu_hours == pytest.approx(2.0)  # still running: up to the period's end
    assert (cost.gpu_cost, cost.upload_cost, cost.total) == (0, 0, 0)
    assert cost.upload_gb == pytest.approx(1.0)
    assert cost.unpriced == ("GPU-hours in ap-south (A100)", "WAN from ap-south")
    # The total is only what was priced: no cost per token or round is made of it.
    assert (cost.per_million_tokens, cost.per_round) == (None, None)


def test_queued_jobs_hold_nothing_and_a_final_state_ends_what_they_hold() -> None:
    log = [
        entry(0, "job.admit", verdict="allow", queued=True),
        entry(3600, "job.admit", to="running", regions=["eu-west"]),
        entry(5400, "job.admit", to="queued"),  # not a start
    ]
    fold = folded(log)
    fold.ended("llm", 7200)  # completed (its record's state), no audit entry of its own
    cost = job_cost(fold.jobs["llm"], LLM, PRICES, Period(0, 10_000))
    assert cost.gpu_hours == pytest.approx(4 * 1.0)


def test_a_region_joining_and_leaving_changes_what_the_job_holds() -> None:
    log = [
        entry(0, "job.admit", verdict="allow"),  # both regions of the spec
        entry(3600, "job.regions", verdict="allow", region="us-east", action="remove"),
        entry(7200, "job.regions", verdict="allow", region="us-east", action="add"),
        entry(7200, "job.regions", verdict="deny", region="eu-west", action="remove"),
        entry(10_800, "job.fail"),
    ]
    cost = job_cost(folded(log).jobs["llm"], LLM, PRICES, Period(0, 20_000))
    assert cost.gpu_hours == pytest.approx(3 * 4 + 2 * 2)


def test_a_pruned_checkpoint_is_stored_only_until_it_was_pruned() -> None:
    log = [
        entry(0, "checkpoint.snapshot", round_=0, size=10**9, location="archive"),
        entry(
            100,
            "round.publish",
            round_=0,
            included=["eu-west"],
            update_size=10**9,
            location="archive",
        ),
        entry(100 + MONTH_S / 2, "checkpoint.prune", removed=[["snapshot", 0], ["update", 7]]),
    ]
    cost = job_cost(folded(log).jobs["llm"], LLM, PRICES, Period(0, 100 + MONTH_S))
    assert cost.storage_gb_months == pytest.approx((100 + MONTH_S / 2) / MONTH_S + 1.0)


def test_entries_of_an_older_version_without_sizes_are_named_within_their_period() -> None:
    log = [
        entry(100, "round.publish", round_=0, included=["eu-west"], location="archive"),
        entry(150, "policy.global_update", verdict="allow", round_=0, region="eu-west"),
    ]
    usage = folded(log).jobs["llm"]
    cost = job_cost(usage, LLM, PRICES, Period(0, 200))
    assert cost.rounds == 1
    assert (cost.download_gb, cost.storage_gb_months) == (0, 0)
    assert cost.unpriced == ("2 audit entries without sizes (older version)",)
    assert job_cost(usage, LLM, PRICES, Period(200, 300)).unpriced == ()


def test_the_publication_that_completes_the_job_ends_what_it_holds() -> None:
    log = [
        entry(0, "job.admit", verdict="allow"),
        entry(3600, "round.publish", round_=4, completed=True, update_size=1, location="archive"),
        # A failure recorded after the job completed (its recovery at a later start) and
        # the final state's time change nothing.
        entry(90_000, "job.fail"),
    ]
    fold = folded(log)
    fold.ended("llm", 90_000)
    cost = job_cost(fold.jobs["llm"], LLM, PRICES, Period(0, 100_000))
    assert cost.gpu_hours == pytest.approx(4 + 2)


def test_team_costs_sum_their_jobs() -> None:
    usage = folded(llm_log()).jobs["llm"]
    first = job_cost(usage, LLM, PRICES, Period(0, 20_000))
    second = job_cost(usage, CostFacts("llm-2", "nlp", LLM.gpus), PRICES, Period(0, 20_000))
    other = job_cost(usage, CostFacts("vit", "vision", {}), PRICES, Period(0, 20_000))
    nlp, vision = team_costs([other, first, second])
    assert (nlp.team, nlp.jobs, vision.team, vision.jobs) == ("nlp", 2, "vision", 1)
    assert nlp.total == pytest.approx(2 * first.total)
    assert nlp.gpu_hours == pytest.approx(2 * first.gpu_hours)
    assert vision.gpu_hours == 0  # states no GPUs


def test_prices_fall_back_to_default_and_follow_the_market() -> None:
    assert PRICES.gpu_hour("eu-west", "H100") == 4.0
    assert PRICES.gpu_hour("eu-west", "L4") == 3.0
    assert PRICES.gpu_hour("eu-west", None) == 3.0
    assert PRICES.gpu_hour("us-east", "H100") == 1.0  # spot
    assert PRICES.gpu_hour("ap-south", None) is None
    assert PRICES.upload_per_gb("us-east") == 0.1
    assert PRICES.download_per_gb("eu-west") == 0.0
    assert PRICES.download_per_gb("ap-south") == 0.08
    assert PRICES.storage_per_gb_month("archive") == 0.02
    assert PriceTable().upload_per_gb("eu-west") is None


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            {"regions": {"x": {"market": "spot", "gpu_hour": {"H100": {"on_demand": 1}}}}},
            "market is spot, but gpu_hour H100 has no spot price",
        ),
        ({"regions": {"x": {"egress_per_gb": {"default": -1}}}}, "greater than or equal to 0"),
        ({"currency": "euro"}, "should match pattern"),
        # A region sends only to the coordinator: a misspelt key is refused, not ignored.
        ({"regions": {"x": {"egress_per_gb": {"cordinator": 1}}}}, "egress_per_gb.cordinator"),
        ({"storage": {"a": {}}}, "per_gb_month"),
    ],
)
def test_a_bad_price_table_is_refused(table: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PriceTable.model_validate(table)


def _problems(text: str) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "c.yaml", base=Path("/etc/geofed"))
    return caught.value.problems


def test_the_coordinators_config_names_the_line_of_a_bad_price() -> None:
    assert parse_config(MINIMAL_COORDINATOR, "c.yaml", base=Path("/")).prices is None
    good = MINIMAL_COORDINATOR + "prices:\n  storage:\n    eu-ckpt: {per_gb_month: 0.02}\n"
    config = parse_config(good, "c.yaml", base=Path("/"))
    assert config.prices is not None
    assert config.prices.storage_per_gb_month("eu-ckpt") == 0.02
    (problem,) = _problems(
        MINIMAL_COORDINATOR + "prices:\n  storage:\n    us-ckpt: {per_gb_month: 1}\n"
    )
    assert problem.startswith("c.yaml:9: prices: ")
    assert "prices.storage names us-ckpt, which the storage section does not configure" in problem
    (problem,) = _problems(
        MINIMAL_COORDINATOR
        + "prices:\n  regions:\n    eu-west:\n      gpu_hour: {default: {on_demand: x}}\n"
    )
    assert problem.startswith("c.yaml:12: prices.regions.eu-west.gpu_hour.default.on_demand:")
    (problem,) = _problems(MINIMAL_COORDINATOR + "prices:\n  regions:\n    'Bad Region': {}\n")
    assert "region" in problem


def test_a_burn_rate_of_one_spends_the_budget_over_its_window() -> None:
    day = 86400.0
    assert burn_rate(100.0, day, 3000.0, 30 * day) == pytest.approx(1.0)
    assert burn_rate(300.0, day / 4, 3000.0, 30 * day) == pytest.approx(12.0)
    assert burn_rate(0.0, day, 3000.0, 30 * day) == 0


async def test_a_cost_refresh_that_fails_or_hangs_leaves_the_scrape_to_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken() -> None:
        raise OSError("database is locked")

    async def hung() -> None:
        await asyncio.sleep(60)

    await refresh_costs(broken, 1.0)
    await refresh_costs(hung, 0.05)
    assert "cost gauges not refreshed: database is locked" in caplog.text
    assert "cost gauges not refreshed: TimeoutError" in caplog.text


def _record(
    job: str, state: str = "running", extra: str = "", updated_at: float = 0.0
) -> JobRecord:
    spec = parse_job_spec(job_yaml(job, extra=extra), "job.yaml")
    return JobRecord(job, spec.to_json(), state, 0.0, updated_at)


def test_the_ledger_prices_jobs_by_their_specs_needs_and_final_states() -> None:
    needs = "needs: {gpus: 2, gpu_kind: H100}\nregion_needs: {us-east: {gpus: 1}}\nteam: nlp\n"
    ledger = UsageLedger()
    unreadable = JobRecord("broken", {"job": "broken"}, "running", 0.0, 0.0)
    records = [
        _record("llm", "completed", needs, updated_at=7200),
        _record("idle"),
        unreadable,
    ]
    ledger.add(records, [entry(0, "job.admit", "llm", verdict="allow")])
    assert ledger.seq > 0
    assert (ledger.knows("llm"), ledger.knows("idle"), ledger.knows("broken")) == (
        True,
        True,
        False,
    )
    report = ledger.report(PRICES, Period(0, 10_000), None)
    # Completed at 7200 (its record): 2 H100 in eu-west, 1 GPU in us-east (spot) for 2 h.
    (llm,) = report.jobs  # the idle job used nothing and is left out
    assert (llm.job, llm.team) == ("llm", "nlp")
    assert llm.gpu_hours == pytest.approx(2 * 3)
    assert llm.gpu_cost == pytest.approx(2 * (2 * 4.0 + 1 * 1.0))
    assert [team.team for team in report.teams] == ["nlp"]
    assert report.to_json()["jobs"][0]["per_million_tokens"] is None  # no tokens
    unpriced = ledger.report(None, Period(0, 10_000), "llm")
    assert (unpriced.priced, unpriced.jobs[0].gpu_cost) == (False, 0)
    assert unpriced.jobs[0].unpriced == (
        "GPU-hours in eu-west (H100)",
        "GPU-hours in us-east (any kind)",
    )


def test_a_period_ends_now_at_the_latest_and_is_checked() -> None:
    now = 1_000_000.0
    assert period_query({}, now) == Period(now - 30 * 86400, now)
    assert period_query({"since": "10", "until": str(now + 86400)}, now) == Period(10, now)
    for query, message in [
        ({"since": str(now + 10)}, "must be before until"),
        ({"since": "20", "until": "10"}, "must be before until"),
        ({"since": "yesterday"}, "must be epoch seconds"),
        ({"until": "nan"}, "must be epoch seconds"),
        ({"since": "-1"}, "must be epoch seconds"),
    ]:
        with pytest.raises(BadRequest, match=message):
            period_query(query, now)


def test_a_jobs_status_projects_its_cost_to_all_its_rounds() -> None:
    usage = folded(llm_log()).jobs["llm"]
    cost = job_cost(usage, LLM, PRICES, Period(0, 4700 + MONTH_S))
    shown = cost_json(cost, "EUR", rounds=10)
    assert shown["total"] == pytest.approx(52.33)
    assert shown["wan"] == pytest.approx(0.24)
    assert shown["projected_total"] == pytest.approx(523.3)  # one round of ten so far
    assert cost_json(cost, "EUR", rounds=None)["projected_total"] is None  # a job that ended
    unpriced = job_cost(usage, LLM, PriceTable(), Period(0, 20_000))  # no prices at all
    assert cost_json(unpriced, "EUR", rounds=10)["projected_total"] is None
    # What it is expected to cost in all: the projection while it runs, what it cost after.
    assert expected_cost(cost, 10, ended=False) == pytest.approx(523.3)
    assert expected_cost(cost, 10, ended=True) == pytest.approx(52.33)
    assert expected_cost(unpriced, 10, ended=True) is None


def test_a_running_jobs_budget_is_shown_with_its_projection() -> None:
    needs = "needs: {gpus: 2}\nteam: nlp\n"
    records = [
        _record("llm", "running", needs + "budget: 400\n"),
        _record("done", "completed", needs + "budget: 50\n", updated_at=9000),
        _record("free", "running", needs),
    ]
    # The same use for each job: its own copy of the log.
    logs = [[replace(e, job=job) for e in llm_log()] for job in ("llm", "done", "free")]
    ledger = UsageLedger()
    ledger.add(records, sorted((e for log in logs for e in log), key=lambda e: e.seq))
    costs = ledger.costs(PRICES, Period(0, 20_000))
    by_job = {cost.job: cost for cost in costs}
    assert set(by_job) == {"llm", "done", "free"}
    assert by_job["llm"].rounds == 1
    assert by_job["llm"].total > 0
    found = job_budgets(ledger, records, costs)
    # "free" states no budget; "done" ended: what it cost is in the usage report.
    assert set(found) == {"llm"}
    team, budget, projected = found["llm"]
    assert (team, budget) == ("nlp", 400)
    assert projected == pytest.approx(3 * by_job["llm"].total)  # one round of three so far
