"""Model state as the federation sees it: a name -> tensor mapping, and its hash.

The federated state of a model is the floating-point part of its ``state_dict()``
(parameters and float persistent buffers) with any DistributedDataParallel wrapper
removed, so a rank-0 worker, an agent and the coordinator name the same tensors the same
way. Other persistent buffers (complex RoPE tables, integer step counters) are rebuilt
by the task's ``build_model`` on every side: they are neither exchanged nor averaged.
Each region reports :func:`parameters_vector_hash` of its reconstructed state every round
and all of them must agree bit for bit.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterator, Mapping

import torch
from torch import nn

_HASH_DOMAIN = b"geofed-params-v1\0"


def unwrap_model(model: nn.Module) -> nn.Module:
    """Return the module inside a DistributedDataParallel wrapper, else ``model`` itself."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        inner: nn.Module = model.module
        return inner
    return model


def is_federated(tensor: torch.Tensor) -> bool:
    """Whether a state entry is federated: floating point (complex and integer are not)."""
    return tensor.is_floating_point()


def federated_state(
    model_or_state: nn.Module | Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Return the federated entries of a model's unwrapped ``state_dict`` or of a mapping.

    The tensors are the model's own (no copy). A mapping is filtered the same way, so a
    full state dict gathered from a sharded model reduces to what the federation carries.
    """
    state: Mapping[str, torch.Tensor]
    if isinstance(model_or_state, nn.Module):
        state = unwrap_model(model_or_state).state_dict()
    else:
        state = model_or_state
    return {name: tensor for name, tensor in state.items() if is_federated(tensor)}


def federated_names(model: nn.Module) -> frozenset[str]:
    """Return the names of a model's federated state."""
    return frozenset(federated_state(model))


def model_state(model_or_state: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Return a model's federated state, or a mapping's entries as they are.

    A mapping is already a state someone chose (a θ read from disk, a test's vector), so
    it is taken whole; only a module is reduced to what the federation exchanges.
    """
    if isinstance(model_or_state, nn.Module):
        return federated_state(model_or_state)
    return dict(model_or_state)


def count_parameters(model: nn.Module) -> int:
    """Return the number of scalar parameters of a (possibly DDP-wrapped) model."""
    return sum(p.numel() for p in unwrap_model(model).parameters())


def shapes_of(
    state: Mapping[str, torch.Tensor] | Mapping[str, tuple[int, ...]],
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of a state's tensors, or of shapes already (a θ file's header), in
    the state's order."""
    return {
        name: tuple(value.shape) if isinstance(value, torch.Tensor) else tuple(value)
        for name, value in state.items()
    }


def shapes_mismatch(
    expected: Mapping[str, tuple[int, ...]], given: Mapping[str, tuple[int, ...]]
) -> str | None:
    """How ``given`` (name -> shape) differs from ``expected``, the first few of each kind
    named; None when they are the same."""
    if dict(expected) == dict(given):
        return None
    missing = sorted(set(expected) - set(given))
    extra = sorted(set(given) - set(expected))
    resized = sorted(n for n in set(expected) & set(given) if expected[n] != given[n])
    return f"it lacks {missing[:5]}, has {extra[:5]} besides, and {resized[:5]} differ in shape"


def check_federated_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Raise :class:`ValueError` unless ``state`` holds exactly the model's federated tensors.

    Names and shapes are checked (whole shapes, so a sharded model's global ones); a
    missing, unexpected or misshapen entry is named.
    """
    targets = federated_state(model)
    missing = sorted(set(targets) - set(state))
    unexpected = sorted(set(state) - set(targets))
    if missing or unexpected:
        raise ValueError(
            f"state does not match the model's federated tensors: "
            f"missing {missing}, unexpected {unexpected}"
        )
    misshapen = [
        f"{name}: {tuple(state[name].shape)} != {tuple(target.shape)}"
        for name, target in sorted(targets.items())
        if tuple(state[name].shape) != tuple(target.shape)
    ]
    if misshapen:
        raise ValueError(f"state has tensors of the wrong shape: {', '.join(misshapen)}")


def load_federated_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` into a model's federated tensors, in place.

    Checked first by :func:`check_federated_state`, so nothing is copied from a state
    that does not fit. Values are cast to the dtype of the model's tensor; buffers
    outside the federated state keep what ``build_model`` gave them.
    """
    check_federated_state(model, state)
    with torch.no_grad():
        for name, target in federated_state(model).items():
            target.copy_(state[name])


def _put(digest: hashlib._Hash, field: bytes | memoryview) -> None:
    # Length-prefixed so no two different states can produce the same byte stream.
    digest.update(struct.pack("<Q", len(field)))
    digest.update(field)


def parameters_vector_hash(model_or_state: nn.Module | Mapping[str, torch.Tensor]) -> str:
    """Return the hex sha256 of names, dtypes, shapes and raw bytes, in sorted name order.

    A module is hashed by its federated state, a mapping as given. Two states hash equal
    only if every tensor is bit-identical (so ``-0.0`` and ``0.0`` differ, as do NaNs
    with different payloads); layout and device do not matter.
    """
    state = model_state(model_or_state)
    hasher = StateHasher(len(state))
    for name in sorted(state):
        tensor = state[name]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state entry {name!r} is {type(tensor).__name__}, not a Tensor")
        hasher.tensor(name, tensor)
    return hasher.hexdigest()


class StateHasher:
    """:func:`parameters_vector_hash` fed one tensor at a time, its bytes in pieces.

    For a state that is never whole in memory (θ read from a file chunk by chunk): call
    :meth:`begin` for each tensor in sorted name order, then :meth:`update` with its raw
    bytes in order; the digest is the one the whole state gives.
    """

    def __init__(self, count: int) -> None:
        self._digest = hashlib.sha256(_HASH_DOMAIN)
        self._digest.update(struct.pack("<Q", count))
        self._left = 0

    def begin(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """Start tensor ``name``; its ``numel x itemsize`` bytes follow by :meth:`update`."""
        if self._left:
            raise ValueError(f"the tensor before {name!r} lacks {self._left} bytes")
        _put(self._digest, name.encode("utf-8"))
        _put(self._digest, str(dtype).encode("ascii"))
        _put(self._digest, struct.pack(f"<{len(shape)}Q", *shape))
        self._left = math.prod(shape) * dtype.itemsize
        self._digest.update(struct.pack("<Q", self._left))

    def tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Tensor ``name`` whole: :meth:`begin` and its bytes (any device or layout)."""
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        self.begin(name, flat.dtype, tuple(tensor.shape))
        if flat.numel():
            self.update(flat.view(torch.uint8).numpy().data)

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """The next raw bytes of the current tensor."""
        size = memoryview(data).nbytes
        if size > self._left:
            raise ValueError(f"{size} bytes given, {self._left} left of the tensor")
        self._digest.update(data)
        self._left -= size

    def hexdigest(self) -> str:
        if self._left:
            raise ValueError(f"the last tensor lacks {self._left} bytes")
        return self._digest.hexdigest()


class HashingReads(Mapping[str, torch.Tensor]):
    """θ's tensors read on demand from ``reads``, hashed as they go.

    Iterates the names in sorted order, :func:`parameters_vector_hash`'s order; each tensor
    read in that order is hashed as it is read, so whoever reads θ whole in iteration
    order (loading it into a model) also hashes it without a second read.
    :meth:`hexdigest` reads and hashes whatever was not read in order (all of θ when
    asked first). ``shapes``: every tensor's shape, as θ's header declares it.
    """

    def __init__(
        self, reads: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]
    ) -> None:
        self._reads = reads
        self._names = sorted(shapes)
        self._shapes = dict(shapes)
        self._hasher = StateHasher(len(self._names))
        self._hashed = 0  # how many of the sorted names are hashed
        self._digest: str | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._reads[name]
        if self._hashed < len(self._names) and self._names[self._hashed] == name:
            self._hash(name, tensor)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def hexdigest(self) -> str:
        """θ's :func:`parameters_vector_hash`, reading the tensors not yet hashed."""
        if self._digest is None:
            for name in self._names[self._hashed :]:
                self._hash(name, self._reads[name])
            self._digest = self._hasher.hexdigest()
        return self._digest

    def _hash(self, name: str, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != tuple(self._shapes[name]):
            raise ValueError(
                f"tensor {name!r} reads as {tuple(tensor.shape)}, declared {self._shapes[name]}"
            )
        self._hasher.tensor(name, tensor)
        self._hashed += 1


def state_to_fp32(
    model_or_state: nn.Module | Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Return a detached CPU copy of the state with floating tensors in float32.

    A module gives its federated state. The entries of a mapping are all copied: integer
    and boolean tensors keep their dtype. The copy shares no memory with the model, so
    training on does not change it.
    """
    state = model_state(model_or_state)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        copy = tensor.detach().to("cpu", copy=True)
        if copy.is_floating_point():
            copy = copy.to(torch.float32)
        out[name] = copy
    return out
