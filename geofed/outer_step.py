"""The outer optimizer's math: turns the averaged pseudo-gradient into the next global parameters.

DiLoCo's outer step is SGD with Nesterov momentum on the pseudo-gradient
Δ = θ_r - mean(θ_local); plain federated averaging is the special case lr 1.0, momentum 0
(θ' = θ_r - Δ = mean(θ_local)). The defaults, lr 0.3 and momentum 0.8 reached by a linear
warm-up over the first 4 rounds, come from a sweep on the bundled example task
(``benchmarks/results/outer_sweep.md``): there the DiLoCo paper's lr 0.7 and momentum
0.9 ended worse than plain averaging, and the warm-up made high momentum at a low lr the
best setting. A low lr starts slowly: there it trails plain averaging for the first two
rounds and leads from the third on, so very short jobs may prefer ``kind: average``.

Without a warm-up the arithmetic is exactly that of ``torch.optim.SGD(nesterov=True,
dampening=0)``, op for op (``buf.mul(μ).add(g)``, ``g.add(buf, alpha=μ)``,
``θ.add(d, alpha=-lr)``), so results are bit-identical to it on the same machine. ``add``
with ``alpha`` is a fused multiply-add in torch's vectorized CPU kernels (AVX2, AVX-512)
and two roundings in its portable kernel, so bit-identity across restarts assumes the same
torch build and CPU capability (``torch.backends.cpu.get_cpu_capability()``); thread count
does not matter.

An ``overlap: streaming`` job steps one fragment of the model per round
(:meth:`OuterOptimizer.step_subset`): the other tensors' momentum waits for their turn.

In the shared core because a region replays it too (:mod:`geofed.eager_start`); the
coordinator takes it from :mod:`coordinator.aggregation.outer_optimizer`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from pydantic import ValidationError
from torch import Tensor

from geofed.deltas import all_finite
from geofed.outer_step_config import OuterOptimizerConfig

__all__ = ["OuterOptimizer", "OuterOptimizerConfig", "OuterOptimizerError"]

_STATE_VERSION = 1


def _saved_config(raw: Any) -> OuterOptimizerConfig:
    """Validate a saved config; one saved before the warm-up option existed had none."""
    if isinstance(raw, Mapping) and "momentum_warmup_rounds" not in raw:
        raw = {**raw, "momentum_warmup_rounds": 0}
    return OuterOptimizerConfig.model_validate(raw)


class OuterOptimizerError(ValueError):
    """Bad input to the outer optimizer or an unusable saved state; nothing was changed."""


def _check_tensors(
    params: Mapping[str, Tensor], grads: Mapping[str, Tensor], buffers: Mapping[str, Tensor]
) -> None:
    if set(params) != set(grads):
        missing, extra = sorted(set(params) - set(grads)), sorted(set(grads) - set(params))
        raise OuterOptimizerError(
            f"pseudo-gradient names differ from parameter names: missing {missing}, "
            f"unexpected {extra}"
        )
    if buffers and set(buffers) != set(params):
        raise OuterOptimizerError(
            f"parameter names differ from the momentum state's: missing "
            f"{sorted(set(buffers) - set(params))}, unexpected {sorted(set(params) - set(buffers))}"
        )
    for name, param in params.items():
        grad = grads[name]
        for what, tensor in (("parameter", param), ("pseudo-gradient", grad)):
            if not isinstance(tensor, Tensor) or tensor.dtype != torch.float32:
                kind = tensor.dtype if isinstance(tensor, Tensor) else type(tensor).__name__
                raise OuterOptimizerError(f"{what} {name!r} must be a float32 tensor, not {kind}")
        if grad.shape != param.shape:
            raise OuterOptimizerError(
                f"pseudo-gradient {name!r} has shape {tuple(grad.shape)}, "
                f"parameter has {tuple(param.shape)}"
            )
        if name in buffers and buffers[name].shape != param.shape:
            raise OuterOptimizerError(
                f"momentum {name!r} has shape {tuple(buffers[name].shape)}, "
                f"parameter has {tuple(param.shape)}"
            )
        if not all_finite(grad):
            raise OuterOptimizerError(f"pseudo-gradient {name!r} contains NaN or Inf")


class OuterOptimizer:
    """SGD with Nesterov momentum over a dict of named fp32 tensors, with savable state."""

    def __init__(self, config: OuterOptimizerConfig | None = None) -> None:
        self._config = config if config is not None else OuterOptimizerConfig()
        self._buffers: dict[str, Tensor] = {}
        self._steps = 0

    @property
    def config(self) -> OuterOptimizerConfig:
        return self._config

    @property
    def steps(self) -> int:
        """Number of outer steps taken (rounds applied) since the state began."""
        return self._steps

    def step(
        self,
        params: Mapping[str, Tensor],
        pseudo_grad: Mapping[str, Tensor],
        *,
        consume: bool = False,
        in_place: bool = False,
    ) -> dict[str, Tensor]:
        """Return the target parameters θ - lr·d for the averaged pseudo-gradient ``g``.

        ``d = g + μ·buf`` with ``buf = μ·buf + g`` (``buf = g`` at the first step), where
        μ is :meth:`OuterOptimizerConfig.momentum_at` the step count. Unless
        ``in_place``, inputs are not mutated and previously returned state tensors are
        never written to; on bad input :class:`OuterOptimizerError` is raised and the
        state is unchanged.
        ``consume``: ``pseudo_grad`` (a dict the caller hands over) loses each tensor once
        its target is made, so that the step never holds it beside all the new tensors.
        ``in_place``: no new tensor but a first step's buffer: each target is made in its
        pseudo-gradient's tensor (handed over) and each momentum buffer moves in its own
        tensor (state tensors returned before change with it); the same ops in the same
        order, so the same bits. Nothing is written before the input is checked.
        """
        _check_tensors(params, pseudo_grad, self._buffers)
        targets, buffers = self._targets(params, pseudo_grad, self._steps, consume, in_place)
        self._buffers = buffers
        self._steps += 1
        return targets

    def step_subset(
        self,
        params: Mapping[str, Tensor],
        pseudo_grad: Mapping[str, Tensor],
        *,
        own_steps: int | None = None,
        consume: bool = False,
        in_place: bool = False,
    ) -> dict[str, Tensor]:
        """:meth:`step` for some of the model's tensors only (a streaming round's fragment).

        ``params`` and ``pseudo_grad`` name the same tensors; their momentum buffers move
        (each starts at its first step), every other buffer is kept as it is, and the step
        count counts this step like any other (it counts rounds). ``own_steps``: the outer
        steps these tensors took before (a fragment's, which steps once every F rounds),
        which set the warm-up's momentum instead of the step count, so the warm-up ramps
        over each tensor's own steps. The fragment's buffers must all exist or none (a
        fragment's tensors are always stepped together); otherwise, or on any bad input,
        :class:`OuterOptimizerError` and the state is unchanged. ``consume`` and
        ``in_place`` are :meth:`step`'s.
        """
        if not params:
            raise OuterOptimizerError("a partial outer step needs at least one tensor")
        held = {name: buf for name, buf in self._buffers.items() if name in params}
        _check_tensors(params, pseudo_grad, held)
        if own_steps is not None and own_steps < 0:
            raise OuterOptimizerError(f"own_steps must be >= 0, got {own_steps}")
        targets, buffers = self._targets(
            params,
            pseudo_grad,
            self._steps if own_steps is None else own_steps,
            consume,
            in_place,
        )
        self._buffers = {**self._buffers, **buffers}
        self._steps += 1
        return targets

    def _targets(
        self,
        params: Mapping[str, Tensor],
        pseudo_grad: Mapping[str, Tensor],
        steps: int,
        consume: bool = False,
        in_place: bool = False,
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The targets of ``params`` after ``steps`` earlier steps and their new momentum
        buffers (state untouched unless ``in_place``; ``pseudo_grad`` emptied as it is used
        when ``consume``)."""
        if (consume or in_place) and not isinstance(pseudo_grad, dict):
            raise OuterOptimizerError("a consumed pseudo-gradient must be a dict")
        cfg = self._config
        momentum = cfg.momentum_at(steps)
        targets: dict[str, Tensor] = {}
        buffers: dict[str, Tensor] = {}
        for name, param in params.items():
            grad = pseudo_grad[name]
            direction = grad
            if cfg.momentum != 0.0:
                # The buffer accumulates from the first step even while a warm-up holds
                # the step's momentum at 0, so the ramp only scales what is already there.
                old = self._buffers.get(name)
                if old is None:
                    buf = grad.clone()
                elif in_place:
                    buf = old.mul_(momentum).add_(grad)
                else:
                    buf = old.mul(momentum).add(grad)
                buffers[name] = buf
                if momentum != 0.0:
                    direction = (grad.add_ if in_place else grad.add)(buf, alpha=momentum)
            if in_place:
                targets[name] = torch.add(param, direction, alpha=-cfg.lr, out=direction)
            else:
                targets[name] = param.add(direction, alpha=-cfg.lr)
            del grad, direction
            if consume:
                assert isinstance(pseudo_grad, dict)
                del pseudo_grad[name]
        return targets, buffers

    def state_dict(self) -> dict[str, Any]:
        """Return the state to persist: config, step count and momentum buffers.

        Only plain types and tensors, so ``torch.save``/``torch.load(weights_only=True)``
        round-trip it bit-exactly. The tensors are not written to by later steps, unless
        those are taken ``in_place``.
        """
        return {
            "version": _STATE_VERSION,
            "config": self._config.model_dump(),
            "steps": self._steps,
            "momentum_buffers": dict(self._buffers),
        }

    def load_state_dict(self, state: Mapping[str, Any], *, copy: bool = True) -> None:
        """Restore a state saved by :meth:`state_dict`; refuse one saved under another config.

        ``copy=False`` takes the state's momentum tensors as they are, for a caller that
        never writes to them (a step makes new buffers; it never writes the old ones) or
        that hands them over (a step taken ``in_place`` moves them where they are).
        """
        if not isinstance(state, Mapping):
            raise OuterOptimizerError(f"saved state must be a mapping, not {type(state).__name__}")
        if state.get("version") != _STATE_VERSION:
            raise OuterOptimizerError(
                f"saved state has version {state.get('version')!r}, expected {_STATE_VERSION}"
            )
        try:
            saved = _saved_config(state.get("config"))
        except ValidationError as exc:
            raise OuterOptimizerError(f"saved outer optimizer config is invalid: {exc}") from None
        if saved != self._config:
            raise OuterOptimizerError(
                f"state was saved with {saved.model_dump()}, this optimizer has "
                f"{self._config.model_dump()}; build the optimizer from the saved config"
            )
        steps = state.get("steps")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise OuterOptimizerError(f"saved step count must be an integer >= 0, got {steps!r}")
        raw = state.get("momentum_buffers")
        if not isinstance(raw, Mapping):
            raise OuterOptimizerError("saved state has no 'momentum_buffers' mapping")
        buffers: dict[str, Tensor] = {}
        for name, tensor in raw.items():
            if not isinstance(tensor, Tensor) or tensor.dtype != torch.float32:
                raise OuterOptimizerError(f"saved momentum {name!r} is not a float32 tensor")
            if not all_finite(tensor):
                raise OuterOptimizerError(f"saved momentum {name!r} contains NaN or Inf")
            buffers[str(name)] = tensor.detach().clone() if copy else tensor.detach()
        if buffers and self._config.momentum == 0.0:
            raise OuterOptimizerError("saved state has momentum buffers but momentum is 0")
        if buffers and steps == 0:
            raise OuterOptimizerError("saved state has momentum buffers but a step count of 0")
        self._buffers = buffers
        self._steps = steps

    @staticmethod
    def from_state_dict(state: Mapping[str, Any], *, copy: bool = True) -> OuterOptimizer:
        """Build an optimizer with the config stored in ``state`` and restore it
        (``copy``: as :meth:`load_state_dict`)."""
        try:
            config = _saved_config(state["config"])
        except (KeyError, TypeError, ValidationError) as exc:
            raise OuterOptimizerError(f"saved outer optimizer config is invalid: {exc}") from None
        optimizer = OuterOptimizer(config)
        optimizer.load_state_dict(state, copy=copy)
        return optimizer
