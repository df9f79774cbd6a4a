"""The coordinator's long-lived collaborators, handed to the engines and the HTTP layer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from coordinator.config import CoordinatorConfig
from coordinator.control import ControlPlane
from coordinator.executors import Executors
from coordinator.metrics import CoordinatorMetrics
from coordinator.residency import ResidencyGate
from coordinator.runtime import Runtime
from coordinator.state.async_store import AsyncStore
from geofed.types import Identity

__all__ = ["Services"]


@dataclass(frozen=True)
class Services:
    """Start-up state, the state store, thread pools, control plane, metrics and clock.

    ``db`` is the state store; its calls run in the store thread. ``clock`` is
    wall-clock POSIX seconds: round deadlines outlive the process.
    """

    runtime: Runtime
    db: AsyncStore
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

    @property
    def residency(self) -> ResidencyGate:
        """The residency gate under the loaded policies."""
        return ResidencyGate(self.runtime.policies, self.db, self.metrics)
