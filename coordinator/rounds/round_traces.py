"""The coordinator's side of the round traces (:mod:`geofed.tracing`).

:meth:`RoundTraces.traceparent` starts a job's ``round`` span when the round is first
announced open (the announcement carries its ``traceparent`` to the regions), and
:meth:`RoundTraces.published` ends it with its ``collect`` and ``publish`` children. A
round that is never published (the job paused, cancelled, failed, or a coordinator
restarted: the next start begins a new trace for it) has its span ended as ``abandoned``
when the job's next round starts or the job ends, so at most one span per job is open.
Without a tracer every call does nothing.
"""

from __future__ import annotations

import logging

from geofed.tracing import JOB_KEY, ROUND_KEY, Attributes, OpenSpan, RoundTracer, SpanSpec

__all__ = ["RoundTraces"]

log = logging.getLogger(__name__)

OUTCOME_KEY = "geofed.round.outcome"


class RoundTraces:
    """The open ``round`` span of each job (see the module docstring)."""

    def __init__(self, tracer: RoundTracer | None) -> None:
        self._tracer = tracer
        self._open: dict[str, tuple[int, OpenSpan]] = {}

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def traceparent(self, job: str, round_: int, opened_at: float, now: float) -> str | None:
        """The ``traceparent`` of ``job``'s round ``round_`` (opened at ``opened_at``),
        starting its span if it has none; a span of an earlier round still open ends."""
        if self._tracer is None:
            return None
        held = self._open.get(job)
        if held is not None and held[0] == round_:
            return held[1].traceparent
        if held is not None:
            held[1].end(now, attributes={OUTCOME_KEY: "abandoned"})
        span = self._tracer.start("round", opened_at, {JOB_KEY: job, ROUND_KEY: round_})
        self._open[job] = (round_, span)
        return span.traceparent

    def published(
        self,
        job: str,
        round_: int,
        *,
        closed_at: float,
        publish_s: float,
        published_at: float,
        included: int,
    ) -> None:
        """End round ``round_``'s span at ``published_at``: collected until ``closed_at``,
        then ``publish_s`` seconds to aggregate and publish ``included`` deltas."""
        held = self._open.get(job)
        if held is None or held[0] != round_:
            return  # started before this coordinator did: no span of it here
        del self._open[job]
        _, span = held
        attributes: Attributes = {JOB_KEY: job, ROUND_KEY: round_}
        children = [
            SpanSpec("collect", span.started_at, closed_at, attributes),
            SpanSpec("publish", published_at - publish_s, published_at, attributes),
        ]
        outcome: Attributes = {OUTCOME_KEY: "published", "geofed.deltas": included}
        span.end(published_at, children=children, attributes=outcome)

    def ended(self, job: str, now: float) -> None:
        """The job ended or left this coordinator: its open span ends as abandoned."""
        held = self._open.pop(job, None)
        if held is not None:
            held[1].end(now, attributes={OUTCOME_KEY: "abandoned"})

    def shutdown(self, timeout_s: float) -> None:
        """Export what is finished, ``timeout_s`` at most (blocking: a thread at the
        daemon's stop)."""
        if self._tracer is not None:
            self._tracer.shutdown(timeout_s)
