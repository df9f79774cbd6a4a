"""Round traces: the coordinator's round span and the regions' spans under it, one trace
per round, made after the fact with the times measured (the OpenTelemetry SDK's in-memory
exporter stands in for the collector)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import ValidationError

from coordinator.rounds.round_traces import RoundTraces
from geofed.control import RoundAnnouncement
from geofed.tracing import RoundTracer, TracingConfig
from regional_agent.rounds.round_spans import RegionTraces, round_span
from regional_agent.rounds.timeline import Interval, RoundTimeline
from tests.support.control_messages import announcement

CONFIG = TracingConfig(otlp_endpoint="http://127.0.0.1:1/v1/traces")
T0 = 1_800_000_000.0


def tracer(exporter: InMemorySpanExporter, service: str, **attributes: str) -> RoundTracer:
    return RoundTracer(CONFIG, service, attributes, exporter=exporter)


def by_name(*exporters: InMemorySpanExporter) -> dict[str, Any]:
    return {span.name: span for e in exporters for span in e.get_finished_spans()}


def timeline(job: str, round_: int) -> RoundTimeline:
    phases = {
        "sync": Interval(T0 + 1, T0 + 2, 1.0),
        "train": Interval(T0 + 2, T0 + 7, 5.0),
        "encode": Interval(T0 + 7, T0 + 7.5, 0.5),
        "upload": Interval(T0 + 7.5, T0 + 9, 1.0),  # in two pieces: busy 1 s of 1.5
    }
    return RoundTimeline(job, round_, phases, Interval(T0 + 2.1, T0 + 6.9, 4.8))


def test_one_trace_per_round_across_the_coordinator_and_a_region() -> None:
    exported, collected = InMemorySpanExporter(), InMemorySpanExporter()
    coordinator = RoundTraces(tracer(exported, "geofed-coordinator"))
    traceparent = coordinator.traceparent("llm", 3, T0, T0)
    assert traceparent is not None
    assert coordinator.traceparent("llm", 3, T0, T0 + 1) == traceparent, "one span a round"
    region = RegionTraces(tracer(collected, "geofed-agent", **{"geofed.region": "eu-west"}))
    region.announced(announcement(job="llm", round=3, trace=traceparent))
    region.finished(timeline("llm", 3))
    coordinator.published(
        "llm", 3, closed_at=T0 + 9.5, publish_s=0.5, published_at=T0 + 10, included=2
    )
    coordinator.shutdown(5.0)  # exports what finished
    region.shutdown(5.0)

    spans = by_name(exported, collected)
    assert set(spans) == {
        "round",
        "collect",
        "publish",
        "region round",
        "sync",
        "train",
        "inner loop",
        "encode",
        "upload",
    }
    root = spans["round"]
    assert root.parent is None
    assert {span.context.trace_id for span in spans.values()} == {root.context.trace_id}
    for child in ("collect", "publish", "region round"):
        assert spans[child].parent.span_id == root.context.span_id, child
    for phase in ("sync", "train", "encode", "upload"):
        assert spans[phase].parent.span_id == spans["region round"].context.span_id, phase
    assert spans["inner loop"].parent.span_id == spans["train"].context.span_id
    seconds = {name: (s.start_time / 1e9 - T0, s.end_time / 1e9 - T0) for name, s in spans.items()}
    assert seconds["round"] == pytest.approx((0, 10))
    assert seconds["collect"] == pytest.approx((0, 9.5))
    assert seconds["publish"] == pytest.approx((9.5, 10))
    assert seconds["region round"] == pytest.approx((1, 9))
    assert seconds["inner loop"] == pytest.approx((2.1, 6.9))
    assert dict(root.attributes) == {
        "geofed.job": "llm",
        "geofed.round": 3,
        "geofed.round.outcome": "published",
        "geofed.deltas": 2,
    }
    assert spans["upload"].attributes["geofed.busy_s"] == 1.0
    assert spans["sync"].attributes["geofed.region"] == "eu-west"
    assert spans["region round"].resource.attributes["service.name"] == "geofed-agent"


def test_a_round_never_published_ends_abandoned_when_the_next_starts_or_the_job_ends() -> None:
    exported = InMemorySpanExporter()
    traces = RoundTraces(tracer(exported, "geofed-coordinator"))
    first = traces.traceparent("llm", 0, T0, T0)
    second = traces.traceparent("llm", 1, T0 + 5, T0 + 5)
    assert first != second
    traces.published("llm", 0, closed_at=T0, publish_s=0, published_at=T0 + 6, included=0)
    traces.ended("llm", T0 + 8)
    traces.ended("llm", T0 + 9)  # nothing open: nothing more
    traces.shutdown(5.0)
    rounds: list[Any] = [s for s in exported.get_finished_spans() if s.name == "round"]
    assert [
        (s.attributes["geofed.round"], s.attributes["geofed.round.outcome"]) for s in rounds
    ] == [(0, "abandoned"), (1, "abandoned")]
    assert [s.end_time / 1e9 - T0 for s in rounds] == pytest.approx([5, 8])
    assert [s.name for s in exported.get_finished_spans()] == ["round", "round"]


def test_without_a_collector_nothing_is_traced() -> None:
    assert RoundTracer.configured(TracingConfig(), "geofed-agent") is None
    traces = RoundTraces(None)
    assert traces.traceparent("llm", 0, T0, T0) is None
    traces.published("llm", 0, closed_at=T0, publish_s=0, published_at=T0, included=0)
    region = RegionTraces(None)
    region.announced(announcement())
    region.finished(timeline("llm", 0))


def test_a_region_round_without_a_trace_is_a_trace_of_its_own_and_an_empty_one_none() -> None:
    exported = InMemorySpanExporter()
    region = RegionTraces(tracer(exported, "geofed-agent"))
    region.finished(timeline("llm", 0))
    region.shutdown(5.0)
    (top,) = [s for s in exported.get_finished_spans() if s.name == "region round"]
    assert top.parent is None
    assert round_span(RoundTimeline("llm", 0, {}, None)) is None


@pytest.mark.parametrize("endpoint", ["otel:4318", "ftp://collector/v1/traces", "http://"])
def test_a_collector_url_must_be_http(endpoint: str) -> None:
    with pytest.raises(ValidationError, match="must be an http:// or https:// URL"):
        TracingConfig(otlp_endpoint=endpoint)


def test_the_announcement_carries_a_traceparent_only_when_set() -> None:
    sent = announcement(trace="00-" + "a" * 32 + "-" + "b" * 16 + "-01")
    assert RoundAnnouncement.model_validate_json(sent.model_dump_json()).trace == sent.trace
    assert "trace" not in announcement().model_dump()


class _StuckCollector(SpanExporter):
    """A collector that never answers (a fake at the outer edge): each export hangs."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def export(self, spans: Any) -> SpanExportResult:
        self.release.wait(30)
        return SpanExportResult.FAILURE


def test_a_collector_that_never_answers_holds_the_stop_up_its_timeout_at_most() -> None:
    stuck = _StuckCollector()
    tracer = RoundTracer(CONFIG, "geofed-agent", exporter=stuck)
    RegionTraces(tracer).finished(timeline("llm", 0))
    started = time.monotonic()
    try:
        assert not tracer.shutdown(0.3)
        assert time.monotonic() - started < 5
    finally:
        stuck.release.set()
