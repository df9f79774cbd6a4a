"""Building a model on the ``meta`` device: shapes without storage, and fills that do nothing.

Under ``torch.device("meta")`` every tensor has a shape and no storage, so the random fills
a module's ``__init__`` runs (``nn.init.normal_``, ``Tensor.normal_`` and their kin) have
nothing to fill. Torch still runs them, through Python reference kernels whose first call
imports ``torch._dynamo``: about a second of CPU and 70 MB resident in a process that
otherwise never compiles anything (the coordinator, which builds a job's model on meta
only to learn its shapes). :func:`on_meta` makes those fills return their tensor as it is.
Everything else runs as usual: an op that computes one tensor from others (a rotary
table's ``outer`` and ``polar``) still goes through its kernel, which may import
``torch._dynamo`` all the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["on_meta"]

#: In-place fills whose meta kernel is a Python reference. ``nn.init.normal_`` is listed
#: itself: it dispatches as one call, so the ``Tensor.normal_`` inside it is never seen.
_FILLS: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.nn.init.normal_,
        Tensor.normal_,
        Tensor.exponential_,
        Tensor.log_normal_,
        Tensor.cauchy_,
        Tensor.geometric_,
    }
)


class _SkipMetaFills(TorchFunctionMode):
    """Returns a meta tensor from a fill of it untouched; runs every other call."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _FILLS:
            # nn.init.normal_ comes with its tensor as a keyword, Tensor methods positional.
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Make tensors on the meta device by default, and their fills no-ops, for the block."""
    with torch.device("meta"), _SkipMetaFills():
        yield
