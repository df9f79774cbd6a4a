"""A region's spans of a round, from its timeline (pure; exported by :mod:`geofed.tracing`).

One ``region round`` span from the first phase's start to the last one's end, with a
child per phase the agent timed (``sync``, ``train``, ``encode``, ``upload``, ``wait``:
:mod:`regional_agent.rounds.timeline`) and the workers' ``inner loop`` inside ``train``.
A phase that ran in pieces (a retried upload) spans its first start to its last end and
says its busy seconds in ``geofed.busy_s``. :class:`RegionTraces` remembers each round's
``traceparent`` from its announcement and exports the round's spans under it once the
timeline closes the round (the job's next announcement).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

from geofed.control import RoundAnnouncement
from geofed.tracing import JOB_KEY, ROUND_KEY, Attributes, RoundTracer, SpanSpec
from regional_agent.rounds.timeline import RoundTimeline

__all__ = ["RegionTraces", "round_span"]

#: Rounds whose traceparent is remembered (the timeline keeps no more open either).
MAX_ROUNDS: Final = 64


def round_span(done: RoundTimeline) -> SpanSpec | None:
    """The spans of the finished round ``done``; None when no phase was timed."""
    if not done.phases:
        return None
    keys: Attributes = {JOB_KEY: done.job, ROUND_KEY: done.round}
    phases = []
    for name, interval in sorted(done.phases.items(), key=lambda item: item[1].start):
        inner: tuple[SpanSpec, ...] = ()
        if name == "train" and done.worker is not None:
            inner = (SpanSpec("inner loop", done.worker.start, done.worker.end, keys),)
        attributes: Attributes = {**keys, "geofed.busy_s": interval.seconds}
        phases.append(SpanSpec(name, interval.start, interval.end, attributes, inner))
    start = min(phase.start for phase in phases)
    end = max(phase.end for phase in phases)
    return SpanSpec("region round", start, end, keys, tuple(phases))


class RegionTraces:
    """The agent's round spans (nothing without a tracer)."""

    def __init__(self, tracer: RoundTracer | None) -> None:
        self._tracer = tracer
        self._parents: OrderedDict[tuple[str, int], str] = OrderedDict()

    def announced(self, announcement: RoundAnnouncement) -> None:
        """Remember the round's traceparent, if the coordinator traces it."""
        if self._tracer is None or announcement.trace is None:
            return
        self._parents[(announcement.job, announcement.round)] = announcement.trace
        while len(self._parents) > MAX_ROUNDS:
            self._parents.popitem(last=False)

    def finished(self, done: RoundTimeline) -> None:
        """Export the spans of the round ``done`` (under the coordinator's round span)."""
        if self._tracer is None:
            return
        spec = round_span(done)
        if spec is not None:
            self._tracer.emit(self._parents.pop((done.job, done.round), None), spec)

    def shutdown(self, timeout_s: float) -> None:
        """Export what is finished, ``timeout_s`` at most (blocking: a thread at the
        agent's stop)."""
        if self._tracer is not None:
            self._tracer.shutdown(timeout_s)
