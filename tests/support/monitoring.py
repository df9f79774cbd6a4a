"""The shipped monitoring files and the metric catalogues they may name.

Shared by the static checks of ``tests/unit/test_dashboard.py`` and the scrape of a real
federation in ``tests/integration/test_metrics_coverage.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from coordinator import metrics as coordinator_metrics
from regional_agent import metrics as agent_metrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "geofed.json"
RULES = ROOT / "deploy" / "prometheus" / "geofed-rules.yml"

#: Both daemons' metrics by name.
CATALOGUE = {spec.name: spec for spec in coordinator_metrics.CATALOGUE + agent_metrics.CATALOGUE}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def catalogued(name: str) -> str | None:
    """The catalogue name ``name`` belongs to (histogram series map to their histogram)."""
    if name in CATALOGUE:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and base in CATALOGUE and CATALOGUE[base].kind == "histogram":
            return base
    return None


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel of a Grafana dashboard document, those inside rows included."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL expression) for every query of every panel."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
