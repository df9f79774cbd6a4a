"""A fake OpenTelemetry collector: an OTLP/HTTP traces endpoint that keeps what it gets.

The outer edge of the tracing tests (a real collector is another product): a real HTTP
server on a free port that decodes each export with the OTLP protobuf schema, as a
collector does, and answers as one.
"""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

__all__ = ["CollectedSpan", "FakeOtlpCollector", "otlp_collector"]


@dataclass(frozen=True, slots=True)
class CollectedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start: float
    end: float
    attributes: dict[str, Any]


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind is not None else None


class FakeOtlpCollector:
    """The spans received so far (:attr:`spans`), and the endpoint URL (:attr:`url`)."""

    def __init__(self) -> None:
        self.spans: list[CollectedSpan] = []
        self.url = ""

    async def _export(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)
        for resource_spans in message.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append(
                        CollectedSpan(
                            service=str(resource.get("service.name")),
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            start=span.start_time_unix_nano / 1e9,
                            end=span.end_time_unix_nano / 1e9,
                            attributes={
                                **resource,
                                **{a.key: _value(a.value) for a in span.attributes},
                            },
                        )
                    )
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )


@asynccontextmanager
async def otlp_collector() -> AsyncIterator[FakeOtlpCollector]:
    """A :class:`FakeOtlpCollector` serving on 127.0.0.1 for the ``async with`` block."""
    collector = FakeOtlpCollector()
    app = web.Application()
    app.router.add_post("/v1/traces", collector._export)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    collector.url = f"http://127.0.0.1:{port}/v1/traces"
    try:
        yield collector
    finally:
        await runner.cleanup()
