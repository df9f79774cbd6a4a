"""Error feedback: carry each round's quantization error into the next delta.

A biased compressor (round-to-nearest) loses the same small error every round; adding
the residual ``compensated - reconstructed`` to the next delta makes the error cancel
over rounds instead of accumulating (EF / EF21). The residual holds float32 and stays
on the delta's device; it belongs in the region's own checkpoint.

The arithmetic is :mod:`geofed.codec.quantized`'s: compensating is
:func:`~geofed.codec.quantized.compensate_tensor`, and the new residual is what the
quantizer computes on the delta's device while it quantizes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from geofed.codec.encoder import EncodedStream
from geofed.codec.errors import CodecError
from geofed.codec.layout import DEFAULT_CHUNK_ELEMENTS
from geofed.codec.quantized import compensate_tensor, quantize_tensors, seal_quantized
from geofed.codec.tensors import check_tensor_name
from geofed.codec_params import CodecParams

_STATE_VERSION = 1


class ErrorFeedbackError(CodecError, ValueError):
    """Residual state or tensors given to :class:`ErrorFeedback` do not fit together."""


class ErrorFeedback:
    """Keeps the quantization residual per tensor name."""

    def __init__(self) -> None:
        self._residual: dict[str, torch.Tensor] = {}

    @property
    def residual(self) -> dict[str, torch.Tensor]:
        """The current residuals (a shallow copy of the mapping)."""
        return dict(self._residual)

    def compensate(self, delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return ``delta + residual`` per tensor, in float32, on the delta's device."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in delta.items():
            _check_tensor(name, tensor)
            residual = self._residual.get(name)
            if residual is not None:
                _check_shape(name, residual, tensor)
            out[name] = compensate_tensor(tensor, residual)
        return out

    def update(
        self,
        compensated: Mapping[str, torch.Tensor],
        reconstructed: Mapping[str, torch.Tensor],
    ) -> None:
        """Set each residual to ``compensated - reconstructed``; all or nothing."""
        if set(compensated) != set(reconstructed):
            missing = sorted(set(compensated) ^ set(reconstructed))
            raise ErrorFeedbackError(f"compensated and reconstructed differ in tensors {missing}")
        new: dict[str, torch.Tensor] = {}
        for name, tensor in compensated.items():
            _check_tensor(name, tensor)
            other = reconstructed[name]
            _check_tensor(name, other)
            _check_shape(name, other, tensor)
            residual = tensor.detach().to(torch.float32, copy=True)
            residual.sub_(other.detach().to(device=residual.device, dtype=torch.float32))
            new[name] = residual
        self._residual.update(new)

    def step(
        self,
        delta: Mapping[str, torch.Tensor],
        codec: CodecParams,
        *,
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
        generator: torch.Generator | None = None,
    ) -> EncodedStream:
        """Compensate ``delta``, encode it, and keep what decoding it will miss.

        The stream records every tensor as float32 (the compensated values); the new
        residual is computed on the delta's device, no stream is decoded.
        """
        compensated = self.compensate(delta)
        quantized, residual = quantize_tensors(
            compensated, codec, chunk_elements=chunk_elements, generator=generator
        )
        stream = seal_quantized(quantized)
        self._residual.update(residual)
        return stream

    def reset(self) -> None:
        self._residual.clear()

    def state_dict(self) -> dict[str, object]:
        return {"version": _STATE_VERSION, "residual": dict(self._residual)}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Replace the residuals with those of ``state``; invalid state changes nothing."""
        if state.get("version") != _STATE_VERSION:
            raise ErrorFeedbackError(
                f"error-feedback state version {state.get('version')!r} is not {_STATE_VERSION}"
            )
        residual = state.get("residual")
        if not isinstance(residual, Mapping):
            raise ErrorFeedbackError("error-feedback state has no 'residual' mapping")
        loaded: dict[str, torch.Tensor] = {}
        for name, tensor in residual.items():
            _check_tensor(name, tensor)
            if tensor.dtype != torch.float32:
                raise ErrorFeedbackError(f"residual {name!r} is {tensor.dtype}, not torch.float32")
            if not bool(torch.isfinite(tensor).all()):
                raise ErrorFeedbackError(f"residual {name!r} holds NaN or Inf")
            loaded[name] = tensor.detach().clone()
        self._residual = loaded


def _check_tensor(name: object, tensor: object) -> None:
    try:
        check_tensor_name(name)
    except CodecError as exc:
        raise ErrorFeedbackError(str(exc)) from exc
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise ErrorFeedbackError(f"{name!r} is not a floating-point tensor")


def _check_shape(name: str, tensor: torch.Tensor, reference: torch.Tensor) -> None:
    if tensor.shape != reference.shape:
        raise ErrorFeedbackError(
            f"{name!r}: shapes {tuple(tensor.shape)} and {tuple(reference.shape)} differ"
        )
