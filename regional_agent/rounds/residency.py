"""The region's own residency gate: may this region's delta leave for the coordinator?

The coordinator checks residency too; the region asks its own policy first, and in one
place: :class:`ExportGate` decides, logs the refusal, counts it
(:meth:`~regional_agent.metrics.AgentMetrics.policy_denied`) and hands the pipeline the
reason to refuse the round with. The pipeline asks before it trains (a round whose delta
could never leave is not trained) and again before every upload: a delta spooled by an
earlier run may meet a policy set that was replaced since.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

from geofed.types import ArtifactKind
from policies import Decision, Endpoint, PolicySet, Provenance, Transfer, decide_transfer
from regional_agent.metrics import AgentMetrics

__all__ = ["ExportGate", "ExportStage", "export_decision"]

log = logging.getLogger(__name__)

#: When the gate is asked: before the round is trained, or before a delta is uploaded.
ExportStage = Literal["training", "upload"]


def export_decision(policies: PolicySet, region: str, datasets: Sequence[str]) -> Decision:
    """May a ``model_delta`` of ``region`` (trained on ``datasets``) go to the coordinator?"""
    transfer = Transfer(
        kind=ArtifactKind.MODEL_DELTA,
        source=Endpoint.of_region(region, policies.jurisdiction_of(region)),
        destination=Endpoint.coordinator(),
        provenance=Provenance.of({region: datasets}),
    )
    return decide_transfer(policies, transfer)


class ExportGate:
    """Decides, logs and counts whether the region's deltas may go to the coordinator."""

    def __init__(
        self,
        policies: PolicySet,
        region: str,
        datasets: Sequence[str],
        metrics: AgentMetrics,
    ) -> None:
        self._policies = policies
        self._region = region
        self._datasets = tuple(datasets)
        self._metrics = metrics

    def refusal(self, job: str, round_: int, stage: ExportStage) -> str | None:
        """None if the delta of ``job`` round ``round_`` may leave; else why not.

        A refusal is logged and counted here, once per question asked.
        """
        decision = export_decision(self._policies, self._region, self._datasets)
        if decision.allowed:
            return None
        reason = f"own policy: {decision}"
        log.warning(
            "job %s round %d: refusing to export the delta (before %s): %s",
            job,
            round_,
            stage,
            reason,
        )
        self._metrics.policy_denied(ArtifactKind.MODEL_DELTA)
        return reason
