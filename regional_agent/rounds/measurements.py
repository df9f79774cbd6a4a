"""What the worker group measured training a round, as the agent exports and judges it.

The region's figures go to the agent's metrics (:meth:`AgentMetrics.round_measured`);
each rank's own times go to the per-rank gauges and into the job's straggler window
(:mod:`regional_agent.rounds.stragglers`), whose verdict is exported per rank and logged
when it changes.
"""

from __future__ import annotations

import logging

from geofed.training_config import Precision
from regional_agent.handoff.training_stats import TrainingStats
from regional_agent.metrics import AgentMetrics
from regional_agent.rounds.stragglers import StragglerRule, StragglerVerdict, StragglerWatch

__all__ = ["RoundMeasurements"]

log = logging.getLogger(__name__)


class RoundMeasurements:
    """Each job's straggler window, and the metrics a round's measurements set."""

    def __init__(self, metrics: AgentMetrics, rule: StragglerRule | None = None) -> None:
        self._metrics = metrics
        self._rule = rule or StragglerRule()
        self._watches: dict[str, StragglerWatch] = {}
        self._straggling: dict[str, tuple[int, ...]] = {}
        #: job -> the round its latest verdict was made after, and the verdict.
        self._verdicts: dict[str, tuple[int, StragglerVerdict]] = {}

    def record(
        self, job: str, round_: int, stats: TrainingStats, devices: int, precision: Precision
    ) -> StragglerVerdict | None:
        """Export round ``round_`` of ``job`` as measured on ``devices``; the straggler
        verdict when the workers reported each rank's times (None otherwise: the job's
        per-rank series and window are dropped rather than left at an older round's)."""
        self._metrics.round_measured(job, stats, devices, precision)
        if not stats.ranks:
            self._metrics.ranks_measured(job, (), ())
            self.forget(job)
            return None
        watch = self._watches.setdefault(job, StragglerWatch(self._rule))
        verdict = watch.observe(round_, stats.ranks)
        self._verdicts[job] = (round_, verdict)
        self._metrics.ranks_measured(job, stats.ranks, verdict.ranks)
        before = self._straggling.get(job, ())
        if verdict.ranks != before:
            self._straggling[job] = verdict.ranks
            if verdict.ranks:
                log.warning("job %s: straggling ranks %s: %s", job, verdict.ranks, verdict.reason)
            else:
                log.info("job %s: no straggling rank any more: %s", job, verdict.reason)
        return verdict

    def verdict(self, job: str, round_: int) -> StragglerVerdict | None:
        """The straggler verdict made after round ``round_`` of ``job`` (None: none was)."""
        found = self._verdicts.get(job)
        return found[1] if found is not None and found[0] == round_ else None

    def forget(self, job: str) -> None:
        """Drop an ended job's window."""
        self._watches.pop(job, None)
        self._straggling.pop(job, None)
        self._verdicts.pop(job, None)
