"""The delta arithmetic every party shares, so reconstructed parameters agree bit for bit.

A region forms its pseudo-gradient with :func:`pseudo_gradient`; the coordinator forms the
update it publishes with :func:`update_to_publish` and keeps what encoding lost with
:func:`feedback_residual`; everyone reconstructs θ_{r+1} with :func:`apply_update` (or, for an
update that names only some of θ's tensors, :func:`apply_partial_update`). Each is
one correctly rounded elementwise fp32 operation per tensor (no fused multiply-add), so the
result does not depend on the machine, the thread count or the SIMD width; the coordinator
and the regional agents must import these definitions rather than restate them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping

import torch
from torch import Tensor

__all__ = [
    "DeltaError",
    "all_finite",
    "apply_partial_update",
    "apply_update",
    "feedback_residual",
    "pseudo_gradient",
    "update_to_publish",
]


class DeltaError(ValueError):
    """Two tensor sets do not match (names, shapes or dtypes); nothing was computed."""


def all_finite(tensor: Tensor) -> bool:
    """Whether every element is finite, in one reduction pass."""
    # NaN propagates through min/max, and +-Inf shows at an end.
    # (torch.isfinite(t).all() materialises a bool tensor and is ~30x slower.)
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def _elementwise(
    what: str,
    left: Mapping[str, Tensor],
    right: Mapping[str, Tensor],
    op: Callable[[Tensor, Tensor], Tensor],
) -> dict[str, Tensor]:
    if set(left) != set(right):
        raise DeltaError(
            f"{what}: tensor names differ: only on the left {sorted(set(left) - set(right))}, "
            f"only on the right {sorted(set(right) - set(left))}"
        )
    out: dict[str, Tensor] = {}
    for name, a in left.items():
        b = right[name]
        _check_pair(what, name, a, b)
        out[name] = op(a, b)
    return out


def _check_pair(what: str, name: str, a: Tensor, b: Tensor) -> None:
    """Refuse two tensors of one name that an elementwise op cannot combine."""
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise DeltaError(f"{what}: tensor {name!r} must be float32 on both sides")
    if a.shape != b.shape:
        raise DeltaError(
            f"{what}: tensor {name!r} has shapes {tuple(a.shape)} and {tuple(b.shape)}"
        )


def _check_names(what: str, params: Mapping[str, Tensor], update: Mapping[str, object]) -> None:
    """Refuse an update that names a tensor θ lacks, or none at all."""
    unknown = [name for name in update if name not in params]
    if unknown:
        raise DeltaError(
            f"{what}: the update names tensors the parameters do not have: {sorted(unknown)[:5]}"
        )
    if not update:
        raise DeltaError(f"{what}: the update names no tensor")


def pseudo_gradient(base: Mapping[str, Tensor], local: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Return the region's pseudo-gradient ``base - local`` (θ_r - θ_local), per tensor."""
    return _elementwise("pseudo_gradient", base, local, torch.sub)


def apply_update(params: Mapping[str, Tensor], update: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Return ``params + update`` (θ_r + û): the one op every party uses to reconstruct θ_{r+1}."""
    return _elementwise("apply_update", params, update, torch.add)


def apply_partial_update(
    params: Mapping[str, Tensor], update: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """Return θ with ``update`` added to the tensors it names, every other tensor as it was.

    An update of a streaming round names one fragment of θ (:mod:`geofed.fragments`); one
    that names every tensor gives the bits of :func:`apply_update`. The named tensors are
    added with the same op, the others are the very same tensors (never written to), and
    the result keeps θ's order. :class:`DeltaError` when the update names a tensor θ does
    not have, or none at all.
    """
    _check_names("apply_partial_update", params, update)
    added = _elementwise(
        "apply_partial_update", {name: params[name] for name in update}, update, torch.add
    )
    return {name: added.get(name, tensor) for name, tensor in params.items()}


def add_update_in_place(params: MutableMapping[str, Tensor], update: dict[str, Tensor]) -> None:
    """``params`` += ``update`` for the tensors ``update`` names, consuming ``update``.

    The bits of :func:`apply_partial_update` (the same add), without a second copy of θ:
    each named tensor of ``params`` is written in place, and each update tensor is dropped
    once added, so ``update`` is empty afterwards. Everything is checked before any
    tensor is written (:class:`DeltaError`, as :func:`apply_partial_update` raises it).
    """
    _check_names("add_update_in_place", params, update)
    for name, b in update.items():
        _check_pair("add_update_in_place", name, params[name], b)
    with torch.no_grad():
        for name in list(update):
            params[name].add_(update.pop(name))


def check_update_layout(
    what: str, params: Mapping[str, Tensor], layout: Mapping[str, tuple[int, ...]]
) -> None:
    """Refuse an update of ``layout`` (name -> shape, float32) that cannot be added to
    ``params`` in place (:class:`DeltaError`, as :func:`add_update_in_place` raises it)."""
    _check_names(what, params, layout)
    for name, shape in layout.items():
        tensor = params[name]
        if tensor.dtype != torch.float32:
            raise DeltaError(f"{what}: tensor {name!r} must be float32 on both sides")
        if tuple(tensor.shape) != tuple(shape):
            raise DeltaError(
                f"{what}: tensor {name!r} has shapes {tuple(tensor.shape)} and {tuple(shape)}"
            )
        if not tensor.is_contiguous():
            raise DeltaError(f"{what}: tensor {name!r} of the parameters is not contiguous")


def add_piece_in_place(
    params: MutableMapping[str, Tensor], name: str, offset: int, values: Tensor
) -> None:
    """``params[name]`` (flattened) ``[offset : offset + len(values)]`` += ``values``: the
    bits of :func:`add_update_in_place` (the same float32 add, element by element) for an
    update that arrives piece by piece; checked first by :func:`check_update_layout`."""
    with torch.no_grad():
        params[name].view(-1)[offset : offset + values.numel()].add_(values)


def update_to_publish(
    params: Mapping[str, Tensor],
    target: Mapping[str, Tensor],
    residual: Mapping[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """Return the global update to encode: ``(target - params) + residual``.

    ``residual`` is the coordinator's error feedback from the previous round
    (:func:`feedback_residual`); after encoding, the coordinator's own θ_{r+1} is
    ``apply_update(params, decoded)``, exactly what the regions reconstruct.
    """
    update = _elementwise("update_to_publish", target, params, torch.sub)
    if residual is None:
        return update
    return _elementwise("update_to_publish", update, residual, torch.add)


def feedback_residual(
    intended: Mapping[str, Tensor], decoded: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """Return the quantization error ``intended - decoded`` to carry into the next round."""
    return _elementwise("feedback_residual", intended, decoded, torch.sub)
