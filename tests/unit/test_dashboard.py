"""The Grafana dashboard, and what it and the alert rules select.

The dashboard must be a valid, importable Grafana dashboard. Its queries and the alert
rules' expressions may name only catalogued metrics (``coordinator.metrics`` and
``regional_agent.metrics``, plus Prometheus' ``up``), select only labels those metrics
carry, with values they can take: a panel on a misspelt name stays empty forever, an
alert on one never fires. (promtool checks and tests the rules in
``tests/integration/test_prometheus_rules.py``.)
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from coordinator.errors import CODES
from coordinator.rounds.records import JobState
from geofed.types import ArtifactKind
from regional_agent import metrics as agent_metrics
from regional_agent.telemetry.node import THROTTLE_REASONS
from tests.support.monitoring import (
    CATALOGUE,
    DASHBOARD,
    ROOT,
    RULES,
    catalogued,
    panels,
    queries,
)
from tests.support.promql import Matcher, Selector, selectors

SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "geofed-rules.test.yml"

# -- the catalogues ---------------------------------------------------------------------

#: Labels every scraped series carries besides its own (prometheus.yml, honor_labels).
SCRAPE_LABELS = frozenset({"job", "instance"})
#: The values fixed-set labels can take, per metric; absent: not checked.
LABEL_VALUES: dict[tuple[str, str], frozenset[str]] = {
    ("geofed_deltas_rejected_total", "code"): CODES,
    ("geofed_policy_decisions_total", "verdict"): frozenset({"allow", "deny"}),
    ("geofed_policy_decisions_total", "kind"): frozenset(
        {kind.value for kind in ArtifactKind} | {"admission"}
    ),
    ("geofed_received_bytes_total", "kind"): frozenset(kind.value for kind in ArtifactKind),
    ("geofed_sent_bytes_total", "kind"): frozenset(kind.value for kind in ArtifactKind),
    # coordinator/rounds/engine.py and api_data.py count "received" deltas and "sent" updates.
    ("geofed_fp32_equivalent_bytes_total", "direction"): frozenset({"received", "sent"}),
    ("geofed_jobs", "state"): frozenset(state.value for state in JobState),
    ("geofed_agent_fp32_equivalent_bytes_total", "direction"): agent_metrics.DIRECTIONS,
    ("geofed_agent_fp32_equivalent_bytes_total", "scheme"): agent_metrics.SCHEMES,
    ("geofed_agent_delta_bytes_total", "scheme"): agent_metrics.SCHEMES,
    ("geofed_agent_round_outcomes_total", "outcome"): agent_metrics.OUTCOMES,
    ("geofed_agent_policy_denials_total", "kind"): frozenset(kind.value for kind in ArtifactKind),
    ("geofed_agent_download_bytes_total", "kind"): frozenset(
        kind.value for kind in agent_metrics.DOWNLOAD_KINDS
    ),
    ("geofed_agent_round_phase_seconds", "phase"): agent_metrics.ROUND_PHASES,
    ("geofed_agent_gpu_throttled", "reason"): frozenset(THROTTLE_REASONS),
    ("geofed_agent_gpu_ecc_errors", "kind"): frozenset({"corrected", "uncorrected"}),
}


def scrape_jobs() -> frozenset[str]:
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    return frozenset(job["job_name"] for job in config["scrape_configs"])


def _literal_values(matcher: Matcher) -> list[str] | None:
    """The values a matcher names, or None when it is not a plain alternation."""
    if "$" in matcher.value:
        return None
    if matcher.op in ("=", "!="):
        return [matcher.value]
    if re.fullmatch(r"[A-Za-z0-9_.:-]+(\|[A-Za-z0-9_.:-]+)*", matcher.value):
        return matcher.value.split("|")
    return None


def problems(expr: str, recorded: frozenset[str] = frozenset()) -> list[str]:
    """What in ``expr`` selects something no catalogued metric exposes."""
    found = []
    for selector in selectors(expr):
        if selector.name in recorded:
            continue
        labels: set[str]
        if selector.name == "up":
            labels = {"job", "instance", "region"}
        else:
            name = catalogued(selector.name)
            if name is None:
                found.append(f"{selector.name}: not in any metrics catalogue")
                continue
            spec = CATALOGUE[name]
            labels = set(spec.labels) | SCRAPE_LABELS
            if spec.kind == "histogram" and selector.name.endswith("_bucket"):
                labels.add("le")
        for matcher in selector.matchers:
            if matcher.label not in labels:
                found.append(f"{selector.name}: has no label {matcher.label!r}")
                continue
            allowed = LABEL_VALUES.get((catalogued(selector.name) or "", matcher.label))
            if selector.name == "up" and matcher.label == "job":
                allowed = scrape_jobs()
            values = _literal_values(matcher)
            if allowed is not None and values is not None:
                found.extend(
                    f"{selector.name}: {matcher.label} is never {value!r}"
                    for value in values
                    if value not in allowed
                )
    return found


# -- the reader itself ----------------------------------------------------------------


def test_selectors_reads_names_and_matchers_and_skips_functions_and_label_lists():
    expr = (
        'sum by (job, region) (increase(geofed_stragglers_total{job=~"$job", region!="x"}'
        "[$__rate_interval])) / on (job) group_left sum by (job) "
        "(rate(geofed_rounds_completed_total[1h] offset 5m)) > bool 0.5 or up == 0"
    )
    assert selectors(expr) == [
        Selector(
            "geofed_stragglers_total",
            (Matcher("job", "=~", "$job"), Matcher("region", "!=", "x")),
        ),
        Selector("geofed_rounds_completed_total"),
        Selector("up"),
    ]


def test_selectors_reads_a_name_matcher_and_braces_inside_strings():
    expr = 'label_replace({__name__="geofed_regions_up", code="a}\\"b"}, "x", "\\"up{", "", "")'
    assert selectors(expr) == [Selector("geofed_regions_up", (Matcher("code", "=", 'a}\\"b'),))]


def test_problems_names_unknown_metrics_labels_and_values():
    assert problems("rate(geofed_rounds_complete_total[5m])") == [
        "geofed_rounds_complete_total: not in any metrics catalogue"
    ]
    assert problems('geofed_region_up{regoin="eu-west"}') == [
        "geofed_region_up: has no label 'regoin'"
    ]
    assert problems('geofed_deltas_rejected_total{code=~"bad_signature|bad_sig"}') == [
        "geofed_deltas_rejected_total: code is never 'bad_sig'"
    ]
    assert problems('up{job="geofed-coordinatr"}') == ["up: job is never 'geofed-coordinatr'"]
    assert problems("histogram_quantile(0.9, rate(geofed_round_duration_seconds_bucket[1h]))") == []
    assert problems("geofed_jobs_bucket") == ["geofed_jobs_bucket: not in any metrics catalogue"]


# -- the dashboard ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


def test_dashboard_is_an_importable_grafana_dashboard(dashboard):
    assert dashboard["schemaVersion"] == 39
    assert dashboard["uid"]
    assert dashboard["title"]
    assert dashboard["id"] is None
    inputs = {entry["name"]: entry for entry in dashboard["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource"
    assert inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
    expected = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == expected, panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", expected) == expected, panel["title"]


def test_dashboard_has_a_job_variable_over_catalogued_metrics(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert "job" in variables
    for variable in variables.values():
        assert variable["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        query = variable["query"]["query"]
        match = re.fullmatch(r"label_values\((\w+), (\w+)\)", query)
        assert match, query
        assert problems(match[1]) == []
        assert match[2] in CATALOGUE[match[1]].labels


def test_every_panel_has_queries_and_every_query_its_own_ref(dashboard):
    for panel in panels(dashboard):
        if panel["type"] == "row":
            assert "targets" not in panel
            continue
        targets = panel["targets"]
        assert targets, f"panel {panel['title']!r} has no query"
        refs = [target["refId"] for target in targets]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in targets:
            assert target["expr"].strip(), panel["title"]


def test_panel_ids_and_titles_are_unique(dashboard):
    every = list(panels(dashboard))
    ids = [panel["id"] for panel in every]
    assert all(isinstance(i, int) and i > 0 for i in ids)
    assert len(ids) == len(set(ids))
    titles = [panel["title"] for panel in every]
    assert len(titles) == len(set(titles))


def test_panels_fit_the_grid_without_overlapping(dashboard):
    boxes: list[tuple[str, tuple[int, int, int, int]]] = []
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        x, y, w, h = grid["x"], grid["y"], grid["w"], grid["h"]
        assert min(w, h) > 0, panel["title"]
        assert min(x, y) >= 0, panel["title"]
        assert x + w <= 24, f"{panel['title']!r} is wider than the grid"
        if panel["type"] == "row":
            assert (x, w, h) == (0, 24, 1), panel["title"]
        for other, (ox, oy, ow, oh) in boxes:
            apart = x + w <= ox or ox + ow <= x or y + h <= oy or oy + oh <= y
            assert apart, f"{panel['title']!r} overlaps {other!r}"
        boxes.append((panel["title"], (x, y, w, h)))


def test_every_query_selects_catalogued_metrics(dashboard):
    found = [
        f"{title}: {problem}" for title, expr in queries(dashboard) for problem in problems(expr)
    ]
    assert found == []


def test_queries_use_only_defined_variables(dashboard):
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    builtin = {"__rate_interval", "__interval", "__range"}
    for title, expr in queries(dashboard):
        for name in re.findall(r"\$\{?(\w+)", expr):
            assert name in defined | builtin, f"{title}: ${name} is not defined"


def test_dashboard_shows_what_operators_watch(dashboard):
    shown = {
        catalogued(selector.name) or selector.name
        for _, expr in queries(dashboard)
        for selector in selectors(expr)
    }
    watched = {
        "geofed_current_round",  # round progress
        "geofed_round_duration_seconds",
        "geofed_region_train_loss",  # loss per region
        "geofed_global_validation_loss",
        "geofed_agent_upload_bytes_total",  # WAN bytes per region
        "geofed_agent_download_bytes_total",
        "geofed_agent_delta_bytes_total",  # compression ratio per region
        "geofed_agent_fp32_equivalent_bytes_total",
        "geofed_region_up",  # regions up
        "geofed_stragglers_total",
        "geofed_deltas_rejected_total",
        "geofed_policy_decisions_total",
        "geofed_agent_policy_denials_total",
        "geofed_last_checkpoint_timestamp_seconds",
        "geofed_agent_worker_restarts_total",
        "geofed_agent_train_seconds_total",  # compute utilisation
        "geofed_agent_wall_seconds_total",
        "geofed_agent_train_tokens_per_second",  # training inside the regions
        "geofed_agent_mfu_ratio",
        "geofed_agent_train_step_seconds",
        "geofed_agent_data_wait_seconds",
        "geofed_agent_allreduce_seconds",
        "geofed_agent_peak_accelerator_memory_bytes",
        "geofed_agent_learning_rate",
        "geofed_agent_grad_norm",
        "geofed_agent_rank_busy_seconds",  # stragglers inside a region
        "geofed_agent_rank_straggler",
    }
    assert watched - shown == set()


# -- the alert rules ------------------------------------------------------------------


def test_rule_expressions_select_only_catalogued_metrics():
    document = yaml.safe_load(RULES.read_text())
    rules = [rule for group in document["groups"] for rule in group["rules"]]
    assert rules
    recorded = frozenset(rule["record"] for rule in rules if "record" in rule)
    found = [
        f"{rule.get('alert') or rule.get('record')}: {problem}"
        for rule in rules
        for problem in problems(rule["expr"], recorded)
    ]
    assert found == []


def test_rule_test_inputs_are_series_the_daemons_export():
    """Inputs with misspelt names or labels would test rules against series that never exist."""
    document = yaml.safe_load(RULE_TESTS.read_text())
    found: list[str] = []
    for case in document["tests"]:
        for series in case["input_series"]:
            found.extend(f"{series['series']}: {p}" for p in problems(series["series"]))
    assert found == []
