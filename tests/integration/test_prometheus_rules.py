"""The alert rules and the scrape config, checked by promtool, and what they select.

promtool comes from Debian's ``prometheus`` package; without it these tests fail (the
Makefile installs it), they do not skip. ``promtool test rules`` runs the unit tests in
``deploy/prometheus/geofed-rules.test.yml``: each alert fires when it should and stays
silent when it should not.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from coordinator.metrics import CoordinatorMetrics, StandbyMetrics
from geofed.types import ArtifactKind
from regional_agent.metrics import AgentMetrics
from tests.support.pki import make_federation

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "geofed-rules.yml"
RULE_TESTS = PROMETHEUS_DIR / "geofed-rules.test.yml"
SCRAPE_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
SEVERITIES = {"critical", "warning"}
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("install promtool: apt-get install -y prometheus")
    return path


def _run(
    *args: str, stdin: bytes | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, input=stdin.decode() if stdin is not None else None, capture_output=True,
        text=True, cwd=cwd, timeout=TIMEOUT_S, check=False,
    )  # fmt: skip


def _rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def _alerts() -> list[dict[str, Any]]:
    return [rule for rule in _rules() if "alert" in rule]


# -- promtool -----------------------------------------------------------------------------


def test_rules_pass_promtool_check(promtool):
    result = _run(promtool, "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


def test_rules_pass_their_promtool_unit_tests(promtool):
    result = _run(promtool, "test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_a_broken_rule_fails_the_unit_tests(promtool, tmp_path):
    """The unit tests notice a threshold that moved (they are not vacuous)."""
    rules = RULES.read_text().replace(
        "increase(geofed_agent_worker_restarts_total[1h]) >= 3",
        "increase(geofed_agent_worker_restarts_total[1h]) >= 4",
    )
    assert rules != RULES.read_text()
    (tmp_path / RULES.name).write_text(rules)
    # Only the cases of that alert, to keep this quick.
    document = yaml.safe_load(RULE_TESTS.read_text())
    document["tests"] = [
        case
        for case in document["tests"]
        if any(c["alertname"] == "GeofedWorkerRestartsHigh" for c in case["alert_rule_test"])
    ]
    assert document["tests"]
    (tmp_path / RULE_TESTS.name).write_text(yaml.safe_dump(document))
    result = _run(promtool, "test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "alertname: GeofedWorkerRestartsHigh" in result.stdout + result.stderr


def test_scrape_config_passes_promtool_with_real_certificates(promtool, tmp_path):
    """The example config, its TLS files replaced by an observer credential of a real CA."""
    federation = make_federation(tmp_path / "pki", "demo")
    observer = federation.observer("prometheus")
    config = SCRAPE_CONFIG.read_text()
    replacements = {
        "/etc/prometheus/geofed/federation-cas.pem": federation.ca_file,
        "/etc/prometheus/geofed/observer/cert.pem": observer.cert_file,
        "/etc/prometheus/geofed/observer/key.pem": observer.key_file,
    }
    for path, replacement in replacements.items():
        assert path in config
        config = config.replace(path, str(replacement))
    (tmp_path / "prometheus.yml").write_text(config)
    shutil.copy(RULES, tmp_path / RULES.name)
    result = _run(promtool, "check", "config", "prometheus.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 33 rules found" in result.stdout
    for job in yaml.safe_load(config)["scrape_configs"]:
        for key in ("ca_file", "cert_file", "key_file"):
            assert Path(job["tls_config"][key]).is_file(), (job["job_name"], key)


def _populated(metrics: object) -> None:
    """Give every labelled collector of ``metrics`` one child, so every name is exposed."""
    for collector in vars(metrics).values():
        if not isinstance(collector, MetricWrapperBase):
            continue
        labels = collector._labelnames
        child = collector.labels(*(["x"] * len(labels))) if labels else collector
        kind = collector._type
        if kind == "counter":
            child.inc()  # type: ignore[attr-defined]
        elif kind == "gauge":
            child.set(1)  # type: ignore[attr-defined]
        else:
            child.observe(3)  # type: ignore[attr-defined]


def test_coordinator_exposition_passes_promtool_check_metrics(promtool):
    registry = CollectorRegistry()
    _populated(CoordinatorMetrics(registry))
    exposition = generate_latest(registry)
    result = _run(promtool, "check", "metrics", stdin=exposition)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout + result.stderr == ""


def test_standby_exposition_passes_promtool_check_metrics(promtool):
    metrics = StandbyMetrics(CollectorRegistry())
    metrics.saw("spiffe://acme/coordinator/main@host-a:4242")
    exposition = generate_latest(metrics.registry)
    assert b"geofed_coordinator_leader 0.0" in exposition
    result = _run(promtool, "check", "metrics", stdin=exposition)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout + result.stderr == ""


def test_agent_exposition_passes_promtool_check_metrics(promtool):
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, "eu-west")
    metrics.set_participating(True)
    with metrics.training():
        pass
    metrics.downloaded(ArtifactKind.GLOBAL_UPDATE, 10)
    _populated(metrics)
    exposition = generate_latest(registry)
    result = _run(promtool, "check", "metrics", stdin=exposition)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout + result.stderr == ""


def test_promtool_check_metrics_does_report_problems(promtool):
    """The exposition checks above can fail: a counter without _total is reported."""
    exposition = b"# HELP geofed_bad A counter.\n# TYPE geofed_bad counter\ngeofed_bad 1\n"
    result = _run(promtool, "check", "metrics", stdin=exposition)
    assert result.returncode != 0
    assert 'counter metrics should have "_total" suffix' in result.stdout + result.stderr


# -- the rules themselves -----------------------------------------------------------------


def test_every_alert_has_for_severity_summary_description_and_runbook():
    alerts = _alerts()
    assert len(alerts) == 33
    names = [alert["alert"] for alert in alerts]
    assert len(names) == len(set(names))
    for alert in alerts:
        name = alert["alert"]
        assert re.fullmatch(r"Geofed[A-Z][A-Za-z0-9]+", name), name
        assert re.fullmatch(r"\d+[smh]", alert.get("for", "")), f"{name}: no for:"
        assert alert["labels"]["severity"] in SEVERITIES, name
        annotations = alert["annotations"]
        assert annotations["summary"].strip(), name
        assert len(annotations["description"]) > len(annotations["summary"]), name
        assert annotations["runbook_url"].startswith("docs/runbooks.md#"), name


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", markdown, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def test_every_runbook_url_points_at_a_runbook_section():
    anchors = _anchors(RUNBOOKS.read_text())
    for alert in _alerts():
        anchor = alert["annotations"]["runbook_url"].partition("#")[2]
        assert anchor in anchors, f"{alert['alert']}: no section #{anchor} in {RUNBOOKS.name}"


def test_runbooks_describe_every_alert_by_name():
    text = RUNBOOKS.read_text()
    for alert in _alerts():
        assert f"`{alert['alert']}`" in text, alert["alert"]


def test_every_alert_is_tested_firing_and_silent():
    document = yaml.safe_load(RULE_TESTS.read_text())
    fired: set[str] = set()
    silent: set[str] = set()
    for case in document["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {alert["alert"] for alert in _alerts()}
    assert names - fired == set(), "never seen firing"
    assert names - silent == set(), "never seen silent"
    assert (fired | silent) - names == set(), "tests of alerts that do not exist"
