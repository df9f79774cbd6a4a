"""When each capacity-scheduled job held its GPUs: the run intervals GPU-hour quotas count.

A job holds its GPUs from the pass that starts it (``job.admit``, ok) until it is
preempted, cancelled, fails or completes; pausing keeps them. The ledger is kept in
memory as the job manager carries transitions out, and rebuilt at start-up from the
audit log (:meth:`RunLedger.replay`), so a restart forgets no usage: the audit log is
the record, read as usage reports read it (:mod:`coordinator.costs.usage_facts`: a job
admitted on fewer regions, or whose regions change, holds only theirs; the publication
that completes it, or else its record's last update, ends its last span).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from coordinator.costs.usage_facts import UsageFold
from coordinator.scheduling import RunInterval
from coordinator.state.audit import AuditEntry

__all__ = ["RunLedger"]


@dataclass(slots=True)
class _Span:
    team: str
    gpus: int
    start: float
    end: float | None = None


class RunLedger:
    """Each job's spans of holding GPUs; the source of :class:`RunInterval` for quotas."""

    def __init__(self) -> None:
        self._spans: dict[str, list[_Span]] = {}

    def started(self, job: str, team: str, gpus: int, at: float) -> None:
        """``job`` took ``gpus`` GPUs at ``at`` (a span already open is left as it is)."""
        spans = self._spans.setdefault(job, [])
        if gpus > 0 and not (spans and spans[-1].end is None):
            spans.append(_Span(team, gpus, at))

    def stopped(self, job: str, at: float) -> None:
        """``job`` gave its GPUs back at ``at`` (nothing if it held none)."""
        spans = self._spans.get(job)
        if spans and spans[-1].end is None:
            spans[-1].end = max(at, spans[-1].start)

    def intervals(self, since: float | None = None) -> list[RunInterval]:
        """Every span (open ones end None), optionally only those still open at ``since``."""
        return [
            RunInterval(span.team, span.gpus, span.start, span.end)
            for spans in self._spans.values()
            for span in spans
            if since is None or span.end is None or span.end >= since
        ]

    def forget_before(self, cutoff: float) -> None:
        """Drop spans that ended before ``cutoff`` (older than every quota window)."""
        for job, spans in list(self._spans.items()):
            kept = [s for s in spans if s.end is None or s.end >= cutoff]
            if kept:
                self._spans[job] = kept
            else:
                del self._spans[job]

    def replay(
        self,
        entries: Iterable[AuditEntry],
        teams: Mapping[str, str],
        regions: Mapping[str, tuple[str, ...]],
        gpus: Mapping[str, Mapping[str, int]],
        finished: Mapping[str, float],
    ) -> None:
        """Rebuild from the audit log (oldest first), read as usage reports read it
        (:class:`~coordinator.costs.usage_facts.UsageFold`): ``teams`` job -> team,
        ``regions`` job -> its regions as submitted, ``gpus`` job -> region -> GPUs it
        needs there (any region it may hold), ``finished`` final job -> when it ended."""
        fold = UsageFold(regions)
        fold.fold(entry for entry in entries if entry.job in gpus)
        for job, at in finished.items():
            fold.ended(job, at)
        for job, usage in fold.jobs.items():
            for span in usage.all_spans():
                held = sum(gpus[job].get(region, 0) for region in span.regions)
                self.started(job, teams[job], held, span.start)
                if span.end is not None:
                    self.stopped(job, span.end)
