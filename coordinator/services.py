"""The coordinator's long-lived collaborators, handed to the engines and the HTTP layer."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.audit import AuditEntry, Verdict
from coordinator.config import CoordinatorConfig
from coordinator.control import ControlPlane
from coordinator.executors import Executors
from coordinator.metrics import CoordinatorMetrics
from coordinator.runtime import Runtime
from coordinator.store import Store
from geofed.types import Identity
from policies import Decision

__all__ = ["Services"]


@dataclass(frozen=True)
class Services:
    """Start-up state, the state store, thread pools, control plane, metrics and clock.

    ``clock`` is wall-clock POSIX seconds: round deadlines outlive the process.
    """

    runtime: Runtime
    store: Store
    executors: Executors
    control: ControlPlane
    metrics: CoordinatorMetrics
    clock: Callable[[], float]

    @property
    def config(self) -> CoordinatorConfig:
        return self.runtime.config

    @property
    def actor(self) -> Identity:
        """The coordinator itself, as the actor of what it decides on its own."""
        return self.runtime.signer.identity

    async def audit(
        self,
        *,
        actor: Identity | str,
        action: str,
        verdict: Verdict | str,
        job: str | None = None,
        round: int | None = None,
        region: str | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> AuditEntry:
        """Append one audit entry (in the store thread)."""
        return await self.executors.db(
            self.store.append_audit,
            actor=actor,
            action=action,
            verdict=verdict,
            job=job,
            round=round,
            region=region,
            details=details,
        )

    async def policy_decision(
        self,
        decision: Decision,
        *,
        kind: str,
        actor: Identity | str,
        job: str | None,
        round: int | None = None,
        region: str | None = None,
    ) -> None:
        """Count a residency decision and append it to the audit log."""
        self.metrics.policy_decision(decision.allowed, kind)
        await self.audit(
            actor=actor,
            action=f"policy.{kind}",
            verdict=Verdict.ALLOW if decision.allowed else Verdict.DENY,
            job=job,
            round=round,
            region=region,
            details=decision.as_dict(),
        )
