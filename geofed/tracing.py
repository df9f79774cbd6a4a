"""Round traces: one OpenTelemetry trace per round, exported over OTLP/HTTP when configured.

The coordinator starts a ``round`` span when it opens a round of a job and ends it when it
publishes the round, with ``collect`` (open to close) and ``publish`` (aggregate, outer
step, encode, sign, store) as its children. The round's announcement carries that span's
W3C ``traceparent``; each agent adds, as its children, a ``region round`` span with the
phases the agent timed (:mod:`regional_agent.rounds.timeline`: ``sync``, ``train`` with
the workers' ``inner loop`` in it, ``encode``, ``upload``, ``wait``). So one trace shows
where a round's time went, across regions and the coordinator.

Off by default: without ``tracing.otlp_endpoint`` in a daemon's config nothing is made,
and the OpenTelemetry SDK is not even imported. Spans are made with explicit times once
what they measure is over, and the SDK's batch processor exports them from a thread of
its own: neither daemon's event loop waits on the collector, and a collector that is
down or slow loses spans (the SDK logs it), never a round.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from geofed.config_sections import ConfigSection

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

__all__ = [
    "JOB_KEY",
    "REGION_KEY",
    "ROUND_KEY",
    "OpenSpan",
    "RoundTracer",
    "SpanSpec",
    "TracingConfig",
]

log = logging.getLogger(__name__)

#: What a span's attributes may hold.
Attributes = Mapping[str, str | int | float | bool]

#: The attribute names every span of a round carries.
JOB_KEY = "geofed.job"
ROUND_KEY = "geofed.round"
REGION_KEY = "geofed.region"


class TracingConfig(ConfigSection):
    """A daemon's ``tracing`` section: where its round spans go (nowhere by default)."""

    otlp_endpoint: str | None = Field(
        default=None,
        description="the OTLP/HTTP traces URL of a collector, e.g. "
        "http://otel-collector:4318/v1/traces; default: none, no traces",
    )
    certificate_file: Path | None = Field(
        default=None, description="CA bundle to verify an https collector (default: the system's)"
    )
    headers: dict[str, str] = Field(
        default_factory=dict, description="HTTP headers sent with each export (e.g. a token)"
    )
    export_interval_s: float = Field(
        default=5.0, gt=0, le=300, description="seconds between two exports of finished spans"
    )
    timeout_s: float = Field(default=10.0, gt=0, le=300, description="per export request")

    def resolved(self, fix: Callable[[Path], Path]) -> TracingConfig:
        """A copy with ``certificate_file`` made absolute by ``fix``."""
        if self.certificate_file is None:
            return self
        return self.model_copy(update={"certificate_file": fix(self.certificate_file)})

    @field_validator("otlp_endpoint")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http:// or https:// URL, got {value!r}")
        return value


@dataclass(frozen=True, slots=True)
class SpanSpec:
    """A span to make after the fact: its name, Unix start and end seconds, attributes
    and children (each within it)."""

    name: str
    start: float
    end: float
    attributes: Attributes = field(default_factory=dict)
    children: Sequence[SpanSpec] = ()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class OpenSpan:
    """A span started now and ended later (the coordinator's ``round``)."""

    def __init__(self, tracer: RoundTracer, span: Span, started_at: float) -> None:
        self._tracer = tracer
        self._span = span
        self.started_at = started_at
        self.traceparent = tracer.traceparent_of(span)

    def end(
        self, at: float, *, children: Sequence[SpanSpec] = (), attributes: Attributes | None = None
    ) -> None:
        """Add ``children`` under it, set ``attributes`` and end it at ``at``."""
        for child in children:
            self._tracer.emit(self.traceparent, child)
        for key, value in (attributes or {}).items():
            self._span.set_attribute(key, value)
        self._span.end(end_time=_ns(at))


class RoundTracer:
    """One daemon's tracer: spans of ``service`` (``attributes`` on each, e.g. its region)
    to the collector of ``config``, or to ``exporter`` (a test's in-memory one)."""

    def __init__(
        self,
        config: TracingConfig,
        service: str,
        attributes: Mapping[str, str] | None = None,
        exporter: SpanExporter | None = None,
    ) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(
                endpoint=config.otlp_endpoint,
                certificate_file=str(config.certificate_file) if config.certificate_file else None,
                headers=dict(config.headers),
                timeout=config.timeout_s,
            )
        resource = Resource.create({"service.name": service, **(attributes or {})})
        self._provider: TracerProvider = TracerProvider(resource=resource)
        self._provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=config.export_interval_s * 1000)
        )
        self._tracer = self._provider.get_tracer("geofed")
        self._propagator = TraceContextTextMapPropagator()
        self._attributes = dict(attributes or {})

    @classmethod
    def configured(
        cls, config: TracingConfig, service: str, attributes: Mapping[str, str] | None = None
    ) -> RoundTracer | None:
        """The tracer ``config`` asks for; None when it names no collector."""
        if config.otlp_endpoint is None:
            return None
        log.info("round traces go to %s", config.otlp_endpoint)
        return cls(config, service, attributes)

    def start(self, name: str, at: float, attributes: Attributes) -> OpenSpan:
        """A root span started at ``at`` (Unix seconds): a new trace."""
        from opentelemetry.context import Context

        span = self._tracer.start_span(
            name, context=Context(), start_time=_ns(at), attributes=dict(attributes)
        )
        return OpenSpan(self, span, at)

    def emit(self, traceparent: str | None, spec: SpanSpec) -> None:
        """Make ``spec`` and its children, under the span ``traceparent`` names (None, or
        one that cannot be read: a trace of its own)."""
        context = self._propagator.extract({"traceparent": traceparent} if traceparent else {})
        self._emit(context, spec)

    def _emit(self, context: Any, spec: SpanSpec) -> None:
        from opentelemetry.trace import set_span_in_context

        span = self._tracer.start_span(
            spec.name,
            context=context,
            start_time=_ns(spec.start),
            attributes={**self._attributes, **spec.attributes},
        )
        inner = set_span_in_context(span)
        for child in spec.children:
            self._emit(inner, child)
        span.end(end_time=_ns(max(spec.end, spec.start)))

    def traceparent_of(self, span: Span) -> str:
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=set_span_in_context(span))
        return carrier["traceparent"]

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Export what is finished now (blocking; tests and shutdown)."""
        return self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self, timeout_s: float) -> bool:
        """Export what is finished and stop the export thread, waiting ``timeout_s`` at
        most (blocking; a collector that is down or slow never holds a daemon's stop up);
        whether it finished in time."""
        done = threading.Thread(target=self._provider.shutdown, name="trace-shutdown", daemon=True)
        done.start()
        done.join(timeout_s)
        if done.is_alive():
            log.warning("round spans not exported within %.1f s of the stop: dropped", timeout_s)
            return False
        return True
