"""Where a delayed round starts under ``overlap_start: eager``: an estimate of θ_{r+1}.

After Kale et al. 2025 ("Eager Updates for Overlapped Communication and Computation in
DiLoCo"). Having handed in round r's result y_r, a region does not know the mean delta
g_r that the coordinator will step with; it estimates it from what it has, putting its
own fresh delta Δ_r = θ_r - y_r in place of its previous one in the previous round's mean::

    ĝ_r = ḡ_{r-1} + (Δ_r - Δ_{r-1}) / M

(M: the regions of the round; in round 0, ḡ_{-1} = Δ_{-1} = 0), and starts round r+1 from
S = θ_r stepped by the job's outer optimizer on ĝ_r. ḡ_{r-1} and the outer momentum are
not sent to regions: :class:`OuterReplica` recovers them from the published θ_r - θ_{r-1}
and the job's outer config by replaying the optimizer. The fold when θ_{r+1} arrives is
the usual y ← θ_{r+1} + (y - S): only the start changes.

Pure tensor math, no I/O: the regional agent and the federation simulator both call it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from geofed.outer_step import OuterOptimizer, OuterOptimizerConfig

__all__ = ["EagerStartError", "OuterReplica", "estimate_mean"]

_STATE_VERSION = 1


class EagerStartError(ValueError):
    """A replica's saved state is unusable, or tensors do not match."""


def estimate_mean(
    theta: Mapping[str, torch.Tensor],
    local: Mapping[str, torch.Tensor],
    last_delta: Mapping[str, torch.Tensor] | None,
    last_mean: Mapping[str, torch.Tensor] | None,
    regions: int,
) -> dict[str, torch.Tensor]:
    """ĝ_r = ḡ_{r-1} + ((θ_r - y_r) - Δ_{r-1}) / M; a missing Δ_{r-1} or ḡ_{r-1} counts as 0."""
    if regions < 1:
        raise EagerStartError(f"regions must be >= 1, got {regions}")
    share = 1.0 / regions
    estimate: dict[str, torch.Tensor] = {}
    for name in theta:
        fresh = theta[name] - local[name]
        if last_delta is not None:
            fresh = fresh - last_delta[name]
        if last_mean is not None:
            estimate[name] = last_mean[name] + share * fresh
        else:
            estimate[name] = share * fresh
    return estimate


class OuterReplica:
    """A region's copy of the coordinator's outer optimizer, rebuilt from published θs.

    Each observed step θ_r → θ_{r+1} is inverted for the mean delta that produced it
    (Nesterov: θ_{r+1} - θ_r = -lr·((1 + μ_r)·g_r + μ_r²·buf_{r-1})), which is then
    stepped through a real :class:`OuterOptimizer` so the momentum buffer follows the
    coordinator's. Exact up to rounding and the update codec's error.

    ``steps`` starts a replica that joins a job late at the coordinator's step count (the
    momentum warm-up depends on it), with no momentum and no previous mean.
    """

    def __init__(self, config: OuterOptimizerConfig, steps: int = 0) -> None:
        self._config = config
        self._optimizer = OuterOptimizer(config)
        if steps:
            self._optimizer.load_state_dict({**self._optimizer.state_dict(), "steps": steps})
        self.last_mean: dict[str, torch.Tensor] | None = None

    @property
    def config(self) -> OuterOptimizerConfig:
        return self._config

    @property
    def steps(self) -> int:
        """Outer steps the replica has taken (or started at)."""
        return self._optimizer.steps

    def observe(
        self, before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]
    ) -> None:
        """Replay the coordinator's step ``before`` → ``after``; keep its mean delta."""
        cfg = self._config
        mu = cfg.momentum_at(self._optimizer.steps)
        buffers = self._optimizer.state_dict()["momentum_buffers"]
        mean: dict[str, torch.Tensor] = {}
        for name, old in before.items():
            direction = (old - after[name]) / cfg.lr
            if name in buffers:
                direction = direction - mu * mu * buffers[name]
            mean[name] = direction / (1.0 + mu)
        self._optimizer.step(before, mean)
        self.last_mean = mean

    def estimate(
        self, params: Mapping[str, torch.Tensor], mean: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """θ after one outer step on ``mean`` from ``params``; the replica is not advanced."""
        trial = OuterOptimizer(self._config)
        trial.load_state_dict(self._optimizer.state_dict())
        return trial.step(params, mean)

    def start(
        self,
        theta: Mapping[str, torch.Tensor],
        local: Mapping[str, torch.Tensor],
        last_delta: Mapping[str, torch.Tensor] | None,
        regions: int,
    ) -> dict[str, torch.Tensor]:
        """S: θ_r stepped on ĝ_r (:func:`estimate_mean`) from this replica's state."""
        return self.estimate(
            theta, estimate_mean(theta, local, last_delta, self.last_mean, regions)
        )

    def state_dict(self) -> dict[str, Any]:
        """Plain types and tensors, for ``torch.save``/``torch.load(weights_only=True)``."""
        return {
            "version": _STATE_VERSION,
            "optimizer": self._optimizer.state_dict(),
            "last_mean": None if self.last_mean is None else dict(self.last_mean),
        }

    @staticmethod
    def from_state_dict(state: Mapping[str, Any], config: OuterOptimizerConfig) -> OuterReplica:
        """Restore a replica saved by :meth:`state_dict` for a job whose outer config is
        ``config``; :class:`EagerStartError` when it is unusable or of another config."""
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            raise EagerStartError("not a saved outer replica of this version")
        replica = OuterReplica(config)
        try:
            replica._optimizer.load_state_dict(state["optimizer"])
        except (KeyError, ValueError) as exc:
            raise EagerStartError(f"saved outer replica: {exc}") from None
        mean = state.get("last_mean")
        if mean is not None:
            if not isinstance(mean, Mapping) or not all(
                isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in mean.values()
            ):
                raise EagerStartError("saved outer replica: last_mean is not fp32 tensors")
            replica.last_mean = {str(name): tensor for name, tensor in mean.items()}
        return replica
