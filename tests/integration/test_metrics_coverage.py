"""Every metric the alert rules and the dashboard select is in a live daemon's /metrics.

``tests/unit/test_dashboard.py`` checks that rules and panels name catalogued metrics;
this checks that the running daemons actually export them. A federation of real
processes (Mosquitto with mTLS, a coordinator, two agents with their worker groups)
completes a round of the example task, and Prometheus' view is taken the way Prometheus
takes it: ``/metrics`` of the coordinator and of each agent over HTTPS with an observer
certificate. A name a rule or a panel selects that its daemon does not expose is a dead
alert or an empty panel; the failure names the alert or panel.

A series that appears only at its first increment is a failure too: ``increase()`` over
a counter born at 1 is 0, so the alert on it would miss the first event.

The same federation traces its rounds (``tracing`` in every daemon's config, a fake OTLP
collector at the outer edge, ``tests/support/otlp_collector.py``): each round is one
trace, the coordinator's ``round`` span with the regions' spans of it under it.

The same federation is watched in a real browser, headless Chromium driven by Playwright
(``tests/support/browser.py``), over mTLS. Without a certificate the TLS handshake is
refused; with a region's certificate ``/ui`` is a 403; an observer's is served. The job is
paused after its second round (so it is live, with its per-job series, when the daemons
are scraped, and has rounds left for the page to see complete); the browser holds the
operator's certificate as the PKCS#12 file the demo writes for a browser, opens ``/ui``,
and must see both regions, and, once the job resumes, a validation-loss curve that grows
by itself (the page's script refetches it) as rounds complete, each region's
training-loss curve, an intact audit chain, and no console error (a
Content-Security-Policy violation would be one). The screenshot is kept in the test's
temporary directory.

The regions train on the CPU. Their MFU is exported because the agents are given a peak
(``workers.peak_flops``), as an operator of CPU regions would; the names the catalogue
marks accelerator-only (``regional_agent.metrics.ACCELERATOR_ONLY``: peak GPU memory)
have no sample on a CPU, and must still be declared by the agent (HELP and TYPE). The
same scrape shows what the workers measured training the round.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from coordinator import metrics as coordinator_metrics
from geofed.api_paths import ApiPaths
from geofed.pki import client_ssl_context, load_trust_bundle
from geofed.pki.httpauth import VerifiedConnector
from geofed.types import Identity, Role
from geofed_cli.demo.browser import write_browser_credential
from regional_agent import metrics as agent_metrics
from regional_agent.telemetry.node import open_nvml
from tests.support.browser import chromium
from tests.support.federation import FEDERATION, FederationRun, running_federation
from tests.support.monitoring import DASHBOARD, RULES, catalogued, queries
from tests.support.otlp_collector import CollectedSpan, otlp_collector
from tests.support.promql import selectors
from tests.support.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REGIONS = ("eu-west", "us-east")
#: Paused after its second round, so that it is live (its per-job series exist) when the
#: daemons are scraped, and has rounds left for the status page to see complete.
ROUNDS = 6
TIMEOUT = aiohttp.ClientTimeout(total=30)
COORDINATOR_NAMES = frozenset(spec.name for spec in coordinator_metrics.CATALOGUE)
AGENT_NAMES = frozenset(spec.name for spec in agent_metrics.CATALOGUE)
#: Synthesised by Prometheus for every target, never exported by a daemon.
SCRAPE_SERIES = frozenset({"up"})
PEAK_FLOPS = 1e11
_VARIABLE = re.compile(r"label_values\((?P<metric>\w+), (?P<label>\w+)\)")


@dataclass(frozen=True)
class Use:
    """One metric name selected by an alert, a recording rule, a panel or a variable."""

    where: str
    name: str
    label: str | None = None  # a variable's label, which some series must carry


def uses() -> Iterator[Use]:
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            where = f"alert {rule['alert']}" if "alert" in rule else f"record {rule['record']}"
            for selector in selectors(rule["expr"]):
                yield Use(where, selector.name)
    dashboard = json.loads(DASHBOARD.read_text())
    for title, expr in queries(dashboard):
        for selector in selectors(expr):
            yield Use(f"panel {title!r}", selector.name)
    for variable in dashboard["templating"]["list"]:
        match = _VARIABLE.fullmatch(variable["query"]["query"])
        assert match, f"variable {variable['name']}: cannot read {variable['query']['query']!r}"
        yield Use(f"variable ${variable['name']}", match["metric"], match["label"])


def configured(scheduling: Path, collector: str) -> Callable[[str, dict[str, Any]], None]:
    """Give each agent a peak per rank, so that its MFU is known on the CPU; give the
    coordinator the scheduling file ``scheduling`` (a team budget: its cost series);
    send every daemon's round spans to ``collector`` (exported every 0.2 s)."""

    def configure(name: str, data: dict[str, Any]) -> None:
        if name == "coordinator" or name.startswith("agent-"):
            data["tracing"] = {"otlp_endpoint": collector, "export_interval_s": 0.2}
        if name.startswith("agent-"):
            data.setdefault("workers", {})["peak_flops"] = PEAK_FLOPS
        if name == "coordinator":
            assert data.get("prices"), "the example coordinator config prices the demo"
            data["scheduling"] = str(scheduling)

    return configure


def round_spans(spans: list[CollectedSpan], round_: int) -> list[CollectedSpan]:
    """The coordinator's ``round`` span and the regions' ``region round`` spans of
    ``round_``."""
    return [
        span
        for span in spans
        if span.name in ("round", "region round") and span.attributes["geofed.round"] == round_
    ]


def exporter(name: str) -> str | None:
    """Which daemon exports ``name`` (a histogram's series map to the histogram)."""
    base = catalogued(name)
    if base in COORDINATOR_NAMES:
        return "coordinator"
    if base in AGENT_NAMES:
        return "agent"
    return None


def series(text: str) -> dict[str, list[dict[str, str]]]:
    """Sample name (``_total``, ``_bucket``... as exposed) -> the label sets of its samples.

    A family declared without samples maps its name to no label sets.
    """
    found: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        found.setdefault(family.name, [])
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample.labels)
    return found


def values(text: str, name: str) -> dict[str, float]:
    """Job -> value of the samples of ``name``."""
    return {
        sample.labels["job"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def missing(use: Use, exposition: dict[str, list[dict[str, str]]], source: str) -> str | None:
    samples = exposition.get(use.name)
    if use.name in agent_metrics.ACCELERATOR_ONLY and samples is not None:
        return None  # declared; samples only on a GPU
    if not samples:
        return f"{use.where}: {use.name} is not in {source}"
    if use.label is not None and not any(use.label in labels for labels in samples):
        return f"{use.where}: no series of {use.name} in {source} has a {use.label!r} label"
    return None


async def agent_metrics_url(fed: FederationRun, region: str, timeout_s: float = 60.0) -> str:
    """The URL the agent bound (the demo configs ask for port 0) from its start-up log."""
    log = fed.work / "logs" / f"agent-{region}.log"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fed.children.check_alive()
        text = log.read_text(errors="replace") if log.exists() else ""
        match = re.search(r"serving metrics on (https://\S+/metrics)", text)
        if match:
            return match[1]
        await asyncio.sleep(0.3)
    raise AssertionError(f"agent {region} logged no metrics URL within {timeout_s} s")


async def scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url) as response:
        body = await response.text()
        assert response.status == 200, f"GET {url}: {response.status} {body}"
        assert response.content_type == "text/plain", response.content_type
        return body


def test_rules_and_dashboard_select_metrics_of_both_daemons() -> None:
    """The reading below is not vacuous: it finds every alert and both daemons' names."""
    found = list(uses())
    alerts = {u.where for u in found if u.where.startswith("alert ")}
    rules = yaml.safe_load(RULES.read_text())
    expected = {f"alert {r['alert']}" for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert alerts == expected
    owners = {exporter(u.name) for u in found if u.name not in SCRAPE_SERIES}
    assert owners == {"coordinator", "agent"}
    assert any(u.where.startswith("panel ") for u in found)
    assert any(u.where.startswith("variable ") for u in found)


@dataclass
class Scraped:
    """What the federation's daemons exported, as Prometheus and a trace collector saw it."""

    traced: list[CollectedSpan]
    coordinator_text: str
    expositions: dict[str, dict[str, dict[str, list[dict[str, str]]]]]
    trained: dict[str, str]
    regions: dict[str, dict[str, Any]]


async def scrape_federation(fed: FederationRun, collector: Any) -> Scraped:
    """Round 0's spans, and ``/metrics`` of the coordinator and of each agent over HTTPS
    with an observer certificate, as Prometheus takes it."""
    # Round 0's spans: the coordinator's at its publication, each region's once the next
    # announcement closed its timeline.
    await eventually(lambda: len(round_spans(collector.spans, 0)) >= 3, timeout_s=30)
    traced = round_spans(collector.spans, 0)
    bundle = load_trust_bundle(fed.federation.trust_bundle)
    observer = client_ssl_context(bundle, fed.observer.cert, fed.observer.key)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=observer), timeout=TIMEOUT
    ) as session:
        coordinator_text = await scrape(session, f"{fed.base}/metrics")
    source = f"the coordinator's {fed.base}/metrics"
    expositions = {"coordinator": {source: series(coordinator_text)}}
    # The demo's region certificates name no host: check the agent's identity instead.
    agent_context = client_ssl_context(bundle, fed.observer.cert, fed.observer.key)
    agent_context.check_hostname = False
    trained: dict[str, str] = {}
    for region in REGIONS:
        url = await agent_metrics_url(fed, region)
        identity = Identity(federation=FEDERATION, role=Role.REGION, name=region)
        connector = VerifiedConnector(bundle, agent_context, expect=identity)
        async with aiohttp.ClientSession(connector=connector, timeout=TIMEOUT) as session:
            text = await scrape(session, url)
        expositions.setdefault("agent", {})[f"the {region} agent's {url}"] = series(text)
        trained[region] = text
    job = await fed.status()
    assert job["state"] == "paused", "the job ended before the scrape: per-job series gone"
    regions = {r["region"]: r for r in (await fed.get("/v1/regions"))["regions"]}
    return Scraped(traced, coordinator_text, expositions, trained, regions)


async def test_every_selected_metric_is_exported_and_the_status_page_shows_the_job(
    tmp_path: Path,
) -> None:
    scheduling = tmp_path / "scheduling.yaml"
    scheduling.write_text("teams:\n  default: {budget: {amount: 1000}}\n")
    async with (
        otlp_collector() as collector,
        running_federation(
            tmp_path,
            regions=REGIONS,
            rounds=ROUNDS,
            inner_steps=3,
            broker="mosquitto",
            customize=configured(scheduling, collector.url),
        ) as fed,
        chromium() as browser,
    ):
        status, body = await fed.submit({**fed.job_spec(), "budget": 100.0})
        assert status == 201, body
        await check_page_access(fed, browser)
        # θ_2: both regions saw round 1 announced, which closes their timelines (and
        # spans) of round 0; a pause sooner could take that announcement's place.
        await fed.wait_round(2)
        await act(fed, "pause")
        await fed.wait_for(lambda s: s["state"] == "paused", timeout_s=30, what="the pause")
        scraped = await scrape_federation(fed, collector)
        await watch_the_status_page(fed, browser, tmp_path)

    check_selected_metrics(scraped)
    check_costs(scraped.coordinator_text)
    check_round_trace(scraped.traced, collector.spans)
    check_hardware_and_training(scraped)


def check_selected_metrics(scraped: Scraped) -> None:
    """Every name a rule, a panel or a variable selects is in its daemon's exposition."""
    expositions = scraped.expositions
    problems: list[str] = []
    checked = 0
    for use in dict.fromkeys(uses()):
        if use.name in SCRAPE_SERIES:
            continue
        daemon = exporter(use.name)
        if daemon is None:
            problems.append(f"{use.where}: {use.name} is in no daemon's metrics catalogue")
            continue
        for source, exposition in expositions[daemon].items():
            checked += 1
            problem = missing(use, exposition, source)
            if problem is not None:
                problems.append(problem)
    assert checked > 0
    assert problems == [], "dead alerts or empty panels:\n" + "\n".join(problems)


def check_costs(coordinator_text: str) -> None:
    """The round's deltas and update are priced (the example's prices); CPU regions hold
    no GPU; the job's budget and its team's are exported with their burn."""
    cost = {
        sample.labels["kind"]: sample.value
        for family in text_string_to_metric_families(coordinator_text)
        for sample in family.samples
        if sample.name == "geofed_job_cost"
    }
    assert cost["gpu"] == 0, cost
    assert min(cost["upload"], cost["download"], cost["storage"]) > 0, cost
    team = {
        sample.name: sample.value
        for family in text_string_to_metric_families(coordinator_text)
        for sample in family.samples
        if sample.name.startswith("geofed_team_") and sample.labels.get("team") == "default"
    }
    budget = {
        sample.name: sample.value
        for family in text_string_to_metric_families(coordinator_text)
        for sample in family.samples
        if sample.name in ("geofed_job_budget", "geofed_job_projected_cost")
    }
    # All its rounds at its cost per round so far: more than one round's cost.
    assert budget["geofed_job_budget"] == 100
    assert budget["geofed_job_projected_cost"] > sum(cost.values())
    assert team["geofed_team_budget"] == 1000
    assert team["geofed_team_cost"] == pytest.approx(sum(cost.values()))
    # All of it spent within the last 6 hours: its pace against 1000 per 30 days.
    assert team["geofed_team_budget_burn_rate"] == pytest.approx(
        sum(cost.values()) / (6 * 3600) / (1000 / (30 * 86400))
    )


def check_round_trace(traced: list[CollectedSpan], spans: list[CollectedSpan]) -> None:
    """Round 0 is one trace: the coordinator's round span, each region's under it."""
    (root,) = [span for span in traced if span.name == "round"]
    assert root.service == "geofed-coordinator"
    assert root.attributes["geofed.round.outcome"] == "published"
    assert {span.trace_id for span in traced} == {root.trace_id}
    by_region = {span.attributes["geofed.region"]: span for span in traced if span.parent_id}
    assert set(by_region) == set(REGIONS), traced
    assert all(span.parent_id == root.span_id for span in by_region.values())
    for region, top in by_region.items():
        phases = {
            span.name
            for span in spans
            if span.parent_id == top.span_id and span.trace_id == root.trace_id
        }
        assert {"sync", "train", "encode", "upload"} <= phases, (region, phases)
        assert root.start <= top.start <= top.end <= root.end + 5, (region, root, top)


def check_hardware_and_training(scraped: Scraped) -> None:
    """Each region's node in its status, and what its workers measured training."""
    nvml, _ = open_nvml()  # whether this machine's agents can read GPUs
    # Each region's status summarizes its node: memory and disk, GPUs where NVML reads them.
    for region in REGIONS:
        hardware = scraped.regions[region]["hardware"]
        assert hardware["host"], hardware
        assert hardware["memory_available_bytes"] > 0, hardware
        assert hardware["state_disk_free_bytes"] > 0, hardware
        assert (hardware["gpus"] is None) == (nvml is None), hardware
    # What the workers measured training the round, as each agent exports it.
    for region, text in scraped.trained.items():
        (job_id,) = values(text, "geofed_agent_train_tokens_per_second")
        for name in (
            "geofed_agent_train_tokens_per_second",
            "geofed_agent_train_step_seconds",
            "geofed_agent_learning_rate",
            "geofed_agent_grad_norm",
            "geofed_agent_allreduce_seconds",
            "geofed_agent_mfu_ratio",
        ):
            assert values(text, name)[job_id] > 0, (region, name)
        assert values(text, "geofed_agent_data_wait_seconds")[job_id] >= 0, region
        # Each rank's own figures (DDP: its busy time is measured), no straggler in one round.
        assert values(text, "geofed_agent_rank_busy_seconds")[job_id] > 0, region
        assert values(text, "geofed_agent_rank_data_wait_seconds")[job_id] >= 0, region
        assert values(text, "geofed_agent_rank_straggler")[job_id] == 0, region
        # The node's hardware: its memory and state disk; without an NVIDIA driver the
        # GPU series are declared with no sample (absent, not zero).
        found = series(text)
        assert found["geofed_agent_state_disk_free_bytes"], region
        assert found["geofed_agent_node_memory_available_bytes"], region
        if nvml is None:
            assert found["geofed_agent_gpus"] == [], region
            assert found["geofed_agent_gpu_utilization_ratio"] == [], region
        else:
            assert found["geofed_agent_gpus"], region
        assert values(text, "geofed_agent_peak_accelerator_memory_bytes") == {}, region
        # Tiny model, CPU ranks: far below the peak given, but the ratio it says.
        assert values(text, "geofed_agent_mfu_ratio")[job_id] < 1, region


async def act(fed: FederationRun, action: str) -> None:
    async with fed.http.post(f"{fed.base}{ApiPaths.job_action(fed.job, action)}") as response:
        assert response.status == 200, await response.text()


async def val_points(page: Any) -> int:
    count: int = await page.locator("svg.val-loss circle.pt").count()
    return count


async def wait_points(page: Any, more_than: int, timeout_s: float) -> int:
    """Wait (the page refreshing itself) until the validation curve has more points."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        points = await val_points(page)
        if points > more_than:
            return points
        await page.wait_for_timeout(500)
    raise AssertionError(f"the validation curve stayed at {more_than} points for {timeout_s} s")


async def check_page_access(fed: FederationRun, browser: Any) -> None:
    """No certificate: the handshake fails. A region's certificate: 403. An observer's: 200."""
    bare = await browser.new_context(ignore_https_errors=True)
    page = await bare.new_page()
    with pytest.raises(Exception, match=r"net::ERR_"):
        await page.goto(f"{fed.base}{ApiPaths.UI}")
    await bare.close()
    region = fed.federation.regions[REGIONS[0]]
    as_region = await browser.new_context(
        ignore_https_errors=True,
        client_certificates=[
            {"origin": fed.base, "certPath": str(region.cert), "keyPath": str(region.key)}
        ],
    )
    page = await as_region.new_page()
    response = await page.goto(f"{fed.base}{ApiPaths.UI}")
    assert response is not None
    assert response.status == 403
    assert "forbidden" in await response.text()
    await as_region.close()
    observer = await browser.new_context(
        ignore_https_errors=True,
        client_certificates=[
            {
                "origin": fed.base,
                "certPath": str(fed.observer.cert),
                "keyPath": str(fed.observer.key),
            }
        ],
    )
    page = await observer.new_page()
    response = await page.goto(f"{fed.base}{ApiPaths.UI}?part=main")
    assert response is not None
    assert response.status == 200
    live = await response.text()  # the part the page's script refetches
    assert 'id="federation"' in live
    assert "<html" not in live
    await observer.close()


async def watch_the_status_page(fed: FederationRun, browser: Any, tmp_path: Path) -> None:
    """The paused job on ``/ui`` as the operator's browser shows it; resumed, its curves
    grow by themselves until it completes."""
    operator = write_browser_credential(fed.federation.operator.directory)
    context = await browser.new_context(
        ignore_https_errors=True,  # the demo CA is not the browser's to trust
        viewport={"width": 1280, "height": 900},
        client_certificates=[
            {"origin": fed.base, "pfxPath": str(operator.p12), "passphrase": operator.passphrase}
        ],
    )
    page = await context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    response = await page.goto(f"{fed.base}{ApiPaths.UI}?refresh=1")
    assert response is not None
    assert response.status == 200, await response.text()
    assert "default-src 'none'" in (await response.header_value("content-security-policy"))

    assert await page.title() == "geofed · demo"
    names = await page.locator("#regions .region-name").all_inner_texts()
    assert set(REGIONS) <= set(names), names  # and the federation's other regions
    for region in REGIONS:
        name = page.locator(".region-name", has_text=region)
        row = page.locator("#regions tbody tr", has=name)
        assert await row.locator(".state").inner_text() != "unknown", region
    assert await page.locator(f"#jobs-table a[href='#job-{fed.job}']").count() == 1
    before = await val_points(page)
    assert before >= 1
    assert before < ROUNDS  # paused with rounds to go: the curve must still grow
    await act(fed, "resume")
    # The page refetches itself: the curve grows while the browser just watches.
    after = await wait_points(page, before, timeout_s=180)
    assert after > before
    for region in REGIONS:
        series_of = page.locator(f"svg.train-loss circle.pt[data-series='{region}']")
        assert await series_of.count() >= 1, region
    assert await page.locator("#chain .chain-ok").count() == 1
    assert await page.locator("#audit-tail tbody tr").count() >= 5
    assert await page.locator("svg.timeline rect.bar").count() >= 1
    # The agents reported how their rounds split: training and communication bars.
    assert await page.locator("svg.timeline rect.bar.train").count() >= 1
    assert await page.locator("svg.timeline rect.bar.comm").count() >= 1

    final = await fed.wait_completed()
    await wait_points(page, len(final["val_loss_history"]) - 1, timeout_s=30)
    shot = tmp_path / "status-page.png"
    await page.screenshot(path=str(shot), full_page=True)
    print(f"status page screenshot: {shot} (validation curve {before} -> {after} points)")
    assert shot.stat().st_size > 10_000
    assert errors == [], errors
    await context.close()
