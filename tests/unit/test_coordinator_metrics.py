"""The metrics catalogue: naming rules, and collectors registered only where asked."""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest

from coordinator.metrics import CATALOGUE, DURATION_BUCKETS_S, CoordinatorMetrics


def test_names_follow_prometheus_conventions() -> None:
    names = [spec.name for spec in CATALOGUE]
    assert len(set(names)) == len(names)
    for spec in CATALOGUE:
        assert spec.name.startswith("geofed_"), spec.name
        assert spec.name.endswith("_total") == (spec.kind == "counter"), spec.name
        if spec.kind == "histogram":
            assert spec.name.endswith("_seconds"), spec.name
        assert "id" not in spec.labels  # ids are unbounded; job and region are configured
    assert DURATION_BUCKETS_S[-1] >= 8 * 3600


def test_every_catalogue_metric_is_exposed_in_the_given_registry_only() -> None:
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry)
    metrics.rounds_completed.labels(job="j").inc()
    metrics.round_duration.labels(job="j").observe(42.0)
    metrics.policy_decision(False, "model_delta")
    text = generate_latest(registry).decode()
    for spec in CATALOGUE:
        assert f"# TYPE {spec.name.removesuffix('_total')}" in text, spec.name
    assert 'geofed_rounds_completed_total{job="j"} 1.0' in text
    assert 'geofed_policy_decisions_total{kind="model_delta",verdict="deny"} 1.0' in text
    assert 'geofed_round_duration_seconds_bucket{job="j",le="60.0"} 1.0' in text
    # A second coordinator in the same process has its own registry; the global one is untouched.
    CoordinatorMetrics(CollectorRegistry())
    assert "geofed_" not in generate_latest(prometheus_client.REGISTRY).decode()
