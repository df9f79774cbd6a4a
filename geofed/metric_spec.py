"""Prometheus metric specs: a metric's name, type, help and labels, and its collector.

Each daemon keeps one catalogue of :class:`MetricSpec` (alert rules and dashboards
reference those names) and builds its collectors from it with :func:`counter`,
:func:`gauge` and :func:`histogram`, always in a registry passed in (never the
process-global one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["MetricKind", "MetricSpec", "counter", "gauge", "histogram", "set_or_remove"]

MetricKind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric: its exposed name, type, help text and label names."""

    name: str
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ()


def _expect(spec: MetricSpec, kind: MetricKind) -> None:
    if spec.kind != kind:
        raise ValueError(f"{spec.name} is a {spec.kind}, not a {kind}")


def counter(spec: MetricSpec, registry: CollectorRegistry) -> Counter:
    """The counter of ``spec`` (named with its ``_total``), registered in ``registry``."""
    _expect(spec, "counter")
    # The client appends _total itself; give it the stem.
    return Counter(spec.name.removesuffix("_total"), spec.help, spec.labels, registry=registry)


def gauge(spec: MetricSpec, registry: CollectorRegistry) -> Gauge:
    """The gauge of ``spec``, registered in ``registry``."""
    _expect(spec, "gauge")
    return Gauge(spec.name, spec.help, spec.labels, registry=registry)


def histogram(spec: MetricSpec, registry: CollectorRegistry, buckets: Sequence[float]) -> Histogram:
    """The histogram of ``spec`` with upper bounds ``buckets``, registered in ``registry``."""
    _expect(spec, "histogram")
    return Histogram(spec.name, spec.help, spec.labels, registry=registry, buckets=buckets)


def set_or_remove(collector: Gauge, labels: Sequence[str], value: float | None) -> None:
    """Set the series ``labels`` of ``collector`` to ``value``; remove it where the value
    is unknown (None), so a figure that was not measured is absent rather than stale."""
    if value is None:
        collector.remove(*labels)
    else:
        collector.labels(*labels).set(float(value))
