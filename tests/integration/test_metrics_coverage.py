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
from geofed.pki import client_ssl_context, load_trust_bundle
from geofed.pki.httpauth import VerifiedConnector
from geofed.types import Identity, Role
from regional_agent import metrics as agent_metrics
from regional_agent.node_telemetry import open_nvml
from tests.support.federation import FEDERATION, FederationRun, running_federation
from tests.support.monitoring import DASHBOARD, RULES, catalogued, queries
from tests.support.otlp_collector import CollectedSpan, otlp_collector
from tests.support.promql import selectors
from tests.support.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REGIONS = ("eu-west", "us-east")
#: Scraped after the first round: the job must still run then, so that per-job series exist
#: (rounds take well under a second here; the federation stops before the job would end).
ROUNDS = 1000
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


async def test_every_selected_metric_is_exported_by_its_daemon(tmp_path: Path) -> None:
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
    ):
        status, body = await fed.submit({**fed.job_spec(), "budget": 100.0})
        assert status == 201, body
        await fed.wait_round(1)
        # Round 0's spans: the coordinator's at its publication, each region's once the
        # next announcement closed its timeline.
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
        assert job["state"] == "running", "the job ended before the scrape: per-job series gone"
        regions = {r["region"]: r for r in (await fed.get("/v1/regions"))["regions"]}

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

    # The round's deltas and update are priced (the example's prices); CPU regions hold no GPU.
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

    # Round 0 is one trace: the coordinator's round span, each region's under it.
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
            for span in collector.spans
            if span.parent_id == top.span_id and span.trace_id == root.trace_id
        }
        assert {"sync", "train", "encode", "upload"} <= phases, (region, phases)
        assert root.start <= top.start <= top.end <= root.end + 5, (region, root, top)

    nvml, _ = open_nvml()  # whether this machine's agents can read GPUs
    # Each region's status summarizes its node: memory and disk, GPUs where NVML reads them.
    for region in REGIONS:
        hardware = regions[region]["hardware"]
        assert hardware["host"], hardware
        assert hardware["memory_available_bytes"] > 0, hardware
        assert hardware["state_disk_free_bytes"] > 0, hardware
        assert (hardware["gpus"] is None) == (nvml is None), hardware
    # What the workers measured training the round, as each agent exports it.
    for region, text in trained.items():
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
