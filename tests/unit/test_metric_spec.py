"""Metric specs and the collectors built from them."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from geofed.metric_spec import MetricSpec, counter, gauge, histogram

REQUESTS = MetricSpec("geofed_test_requests_total", "counter", "Requests.", ("code",))
DEPTH = MetricSpec("geofed_test_depth", "gauge", "Queue depth.")
LATENCY = MetricSpec("geofed_test_latency_seconds", "histogram", "Latency.", ("code",))


def test_collectors_expose_the_specs_names_and_labels() -> None:
    registry = CollectorRegistry()
    counter(REQUESTS, registry).labels(code="ok").inc(2)
    gauge(DEPTH, registry).set(3)
    histogram(LATENCY, registry, (1.0, 10.0)).labels(code="ok").observe(5.0)
    text = generate_latest(registry).decode()
    assert 'geofed_test_requests_total{code="ok"} 2.0' in text
    assert "# HELP geofed_test_requests_total Requests." in text
    assert "geofed_test_depth 3.0" in text
    assert 'geofed_test_latency_seconds_bucket{code="ok",le="10.0"} 1.0' in text
    assert 'geofed_test_latency_seconds_bucket{code="ok",le="1.0"} 0.0' in text


def test_registries_are_separate() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    counter(REQUESTS, first).labels(code="ok").inc()
    counter(REQUESTS, second)
    assert first.get_sample_value("geofed_test_requests_total", {"code": "ok"}) == 1.0
    assert second.get_sample_value("geofed_test_requests_total", {"code": "ok"}) is None


@pytest.mark.parametrize(
    ("build", "spec"),
    [(counter, DEPTH), (gauge, REQUESTS), (counter, LATENCY)],
)
def test_a_collector_of_another_kind_is_refused(build, spec: MetricSpec) -> None:
    with pytest.raises(ValueError, match=f"{spec.name} is a {spec.kind}"):
        build(spec, CollectorRegistry())


def test_a_histogram_needs_a_histogram_spec() -> None:
    with pytest.raises(ValueError, match="is a gauge, not a histogram"):
        histogram(DEPTH, CollectorRegistry(), (1.0,))
