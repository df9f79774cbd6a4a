"""Model state as the federation sees it: a name -> tensor mapping, and its hash.

The synchronised state of a model is its ``state_dict()`` (parameters and persistent
buffers) with any DistributedDataParallel wrapper removed, so a rank-0 worker, an
agent and the coordinator name the same tensors the same way. Each region reports
:func:`parameters_vector_hash` of its reconstructed state every round and all of them
must agree bit for bit.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping

import torch
from torch import nn

_HASH_DOMAIN = b"geofed-params-v1\0"


def unwrap_model(model: nn.Module) -> nn.Module:
    """Return the module inside a DistributedDataParallel wrapper, else ``model`` itself."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        inner: nn.Module = model.module
        return inner
    return model


def model_state(model_or_state: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Return the named tensors of a model (unwrapped ``state_dict``) or of a mapping as is."""
    if isinstance(model_or_state, nn.Module):
        return dict(unwrap_model(model_or_state).state_dict())
    return dict(model_or_state)


def _put(digest: hashlib._Hash, field: bytes | memoryview) -> None:
    # Length-prefixed so no two different states can produce the same byte stream.
    digest.update(struct.pack("<Q", len(field)))
    digest.update(field)


def parameters_vector_hash(model_or_state: nn.Module | Mapping[str, torch.Tensor]) -> str:
    """Return the hex sha256 of names, dtypes, shapes and raw bytes, in sorted name order.

    Two states hash equal only if every tensor is bit-identical (so ``-0.0`` and ``0.0``
    differ, as do NaNs with different payloads); layout and device do not matter.
    """
    state = model_state(model_or_state)
    digest = hashlib.sha256(_HASH_DOMAIN)
    digest.update(struct.pack("<Q", len(state)))
    for name in sorted(state):
        tensor = state[name]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state entry {name!r} is {type(tensor).__name__}, not a Tensor")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        _put(digest, name.encode("utf-8"))
        _put(digest, str(flat.dtype).encode("ascii"))
        _put(digest, struct.pack(f"<{tensor.dim()}Q", *tensor.shape))
        if flat.numel():
            _put(digest, flat.view(torch.uint8).numpy().data)
        else:
            _put(digest, b"")
    return digest.hexdigest()


def state_to_fp32(
    model_or_state: nn.Module | Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Return a detached CPU copy of the state with floating tensors in float32.

    Integer and boolean tensors (step counters, masks) keep their dtype; the copy shares
    no memory with the model, so training on does not change it.
    """
    state = model_state(model_or_state)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        copy = tensor.detach().to("cpu", copy=True)
        if copy.is_floating_point():
            copy = copy.to(torch.float32)
        out[name] = copy
    return out
