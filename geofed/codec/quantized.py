"""Quantized tensors: the payloads of a stream's chunks, made apart from their framing.

Encoding has two steps. Quantizing (:func:`quantize_tensors`) runs where the tensors
are, an accelerator included, and yields each chunk's payload (scales and codes) on the
host; with error feedback it also returns the new residual, computed there from the
codes and scales (no payload is decoded). Sealing (:func:`seal_quantized`) compresses
where it pays, frames and hashes those payloads: host work, which another process may
do. :class:`QuantizedTensors` is what passes between the two, through
:meth:`~QuantizedTensors.to_state` and :meth:`~QuantizedTensors.from_state` (a state
that ``torch.save`` writes and ``torch.load(weights_only=True)`` reads). Quantizing and
sealing give the bytes :func:`geofed.codec.encode_stream` gives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch

from geofed.codec.compression import CompressionPolicy
from geofed.codec.encoder import (
    EncodedStream,
    check_encoding,
    check_sealing,
    describe_tensors,
    frame_payloads,
    quantize_slots,
    restored_on_failure,
    seal_payloads,
)
from geofed.codec.errors import CodecError, EncodeError
from geofed.codec.layout import (
    DEFAULT_CHUNK_ELEMENTS,
    SCALE_BYTES,
    ChunkSlot,
    check_chunk_elements,
    chunk_slots,
    num_blocks,
    payload_size,
)
from geofed.codec.quantize import BlockCodec, check_scale_range
from geofed.codec.tensors import TensorLayout
from geofed.codec.wire import Sealed
from geofed.codec_params import CodecParams

_STATE_VERSION: Final = 1
_STATE_KEYS: Final = frozenset(
    {"version", "codec", "chunk_elements", "tensors", "payload_sizes", "payloads"}
)


class InvalidQuantized(CodecError, ValueError):
    """Quantized tensors (or their state) do not fit their own layout."""


@dataclass(frozen=True, eq=False)
class QuantizedTensors:
    """Named tensors quantized chunk by chunk: what a stream's chunks carry, before framing.

    ``payloads`` are uint8, 1-D, on the host, one per chunk slot in
    :func:`geofed.codec.layout.chunk_slots` order, each of its
    :func:`~geofed.codec.layout.payload_size`.
    """

    specs: list[TensorLayout]
    codec: CodecParams
    chunk_elements: int
    payloads: list[torch.Tensor]

    @property
    def fp32_bytes(self) -> int:
        """What the same tensors weigh as raw float32, the reference for ratios."""
        return 4 * sum(spec.numel for spec in self.specs)

    def to_state(self) -> dict[str, Any]:
        """A plain state (str, int, bool, list, dict, one uint8 tensor) for ``torch.save``."""
        payloads = self.payloads
        return {
            "version": _STATE_VERSION,
            "codec": self.codec.as_dict(),
            "chunk_elements": self.chunk_elements,
            "tensors": [[spec.name, spec.dtype, list(spec.shape)] for spec in self.specs],
            "payload_sizes": [payload.numel() for payload in payloads],
            # One storage: torch.save pays per storage, and a model has many small chunks.
            "payloads": torch.cat(payloads) if payloads else torch.empty(0, dtype=torch.uint8),
        }

    @staticmethod
    def from_state(state: object, where: str = "quantized delta") -> QuantizedTensors:
        """Rebuild and check quantized tensors from :meth:`to_state`'s output.

        Every field is checked (types, names, dtypes, shapes, codec, chunk size, the
        number and size of the payloads, their scales); raises :class:`InvalidQuantized`
        naming ``where`` and the field.
        """
        return _from_state(state, where)


def quantize_tensors(
    tensors: Mapping[str, torch.Tensor],
    codec: CodecParams,
    *,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    generator: torch.Generator | None = None,
    residual: Mapping[str, torch.Tensor] | None = None,
) -> tuple[QuantizedTensors, dict[str, torch.Tensor]]:
    """Quantize ``tensors`` (plus ``residual``, for error feedback) on their own device.

    Returns the payloads (on the host) and the new residual per tensor: ``compensated -
    reconstructed`` in float32 on the tensor's device, computed by the quantizer itself,
    where ``compensated`` is ``tensor`` in float32 plus its residual (as
    :meth:`geofed.codec.ErrorFeedback.compensate` computes it). ``residual`` must name
    exactly the tensors, with their shapes; with it the tensors quantized are the
    float32 sums, and recorded as float32. Without it each tensor is recorded in its own
    dtype, and the residual is exact for what a float32 tensor decodes to: error feedback
    wants float32 tensors.

    Sealing the result (:func:`seal_quantized`) gives the bytes of
    :func:`geofed.codec.encode_stream` for the same tensors. ``generator`` drives
    stochastic rounding, on the tensors' device, and is restored if quantizing fails.
    Raises :class:`EncodeError` (:class:`NonFiniteValue` for NaN/Inf) naming the tensor.
    """
    check_encoding(codec, chunk_elements)
    specs, flats = describe_tensors(tensors)
    owned = residual is not None
    if residual is not None:
        flats = _compensated(specs, flats, residual)
        specs = [dataclasses.replace(spec, dtype="float32") for spec in specs]
    residuals = [
        torch.empty(flat.numel(), dtype=torch.float32, device=flat.device) for flat in flats
    ]
    payloads: list[torch.Tensor] = []
    with restored_on_failure(generator):
        for slot, payload in quantize_slots(
            specs,
            flats,
            codec,
            chunk_elements,
            generator=generator,
            reuse_buffer=False,
            residuals=residuals,
        ):
            if not owned and _shares_memory(payload, flats[slot.tensor]):
                # An fp32 payload of a float32 CPU tensor is a view of the caller's tensor.
                payload = payload.clone()
            payloads.append(payload)
    quantized = QuantizedTensors(specs, codec, chunk_elements, payloads)
    new = {spec.name: out.view(spec.shape) for spec, out in zip(specs, residuals, strict=True)}
    return quantized, new


def seal_quantized(
    quantized: QuantizedTensors,
    *,
    workers: int = 1,
    compression: CompressionPolicy = "auto",
    zstd_threads: int = 0,
) -> EncodedStream:
    """Frame (and compress where it pays) already-quantized payloads into a stream.

    ``workers``, ``compression`` and ``zstd_threads`` mean what they mean for
    :func:`geofed.codec.encode_stream`.
    """
    check_sealing(workers, compression, zstd_threads)
    slots = _checked_slots(quantized, "quantized tensors")
    return seal_payloads(
        quantized.specs,
        quantized.codec,
        quantized.chunk_elements,
        zip(slots, quantized.payloads, strict=True),
        workers=workers,
        compression=compression,
        zstd_threads=zstd_threads,
    )


def write_quantized(
    quantized: QuantizedTensors,
    write: Callable[[bytes], object],
    *,
    workers: int = 1,
    compression: CompressionPolicy = "auto",
    zstd_threads: int = 0,
) -> list[int]:
    """:func:`seal_quantized`'s stream, handed to ``write`` frame by frame as each is
    sealed (the same bytes; no frame is kept once written); returns the frames' sizes in
    order: header, chunks, trailer."""
    check_sealing(workers, compression, zstd_threads)
    slots = _checked_slots(quantized, "quantized tensors")
    sizes: list[int] = []

    def out(sealed: Sealed) -> None:
        write(sealed.data)
        sizes.append(len(sealed.data))

    trailer = frame_payloads(
        quantized.specs,
        quantized.codec,
        quantized.chunk_elements,
        zip(slots, quantized.payloads, strict=True),
        out,
        lambda _slot, sealed: out(sealed),
        workers=workers,
        compression=compression,
        zstd_threads=zstd_threads,
    )
    out(trailer)
    return sizes


def dequantize(quantized: QuantizedTensors) -> dict[str, torch.Tensor]:
    """The values the payloads decode to: CPU tensors of their recorded dtype and shape.

    The same bits as :func:`geofed.codec.decode` of the sealed stream (float32 for what
    error feedback quantizes). Raises :class:`CorruptChunk` on an impossible scale.
    """
    slots = _checked_slots(quantized, "quantized tensors")
    codec = BlockCodec(quantized.codec.scheme, quantized.codec.block_size)
    out = {spec.name: torch.empty(spec.shape, dtype=spec.torch_dtype) for spec in quantized.specs}
    for slot, payload in zip(slots, quantized.payloads, strict=True):
        name = quantized.specs[slot.tensor].name
        target = out[name].view(-1)[slot.offset : slot.offset + slot.count]
        values = codec.decode(
            payload,
            slot.count,
            label=_label(slot, name),
            out=target if target.dtype == torch.float32 else None,
        )
        if values is not target:
            target.copy_(values)
    return out


def compensate_tensor(tensor: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``tensor`` in float32 (a new tensor, on its device), plus ``residual`` when given."""
    compensated = tensor.detach().to(torch.float32, copy=True)
    if residual is not None:
        compensated.add_(residual.to(compensated.device))
    return compensated


def _compensated(
    specs: Sequence[TensorLayout],
    flats: Sequence[torch.Tensor],
    residual: Mapping[str, torch.Tensor],
) -> list[torch.Tensor]:
    if not isinstance(residual, Mapping):
        raise EncodeError(
            f"residual must be a mapping of name to tensor, not {type(residual).__name__}"
        )
    names = [spec.name for spec in specs]
    missing = sorted(set(names) - set(residual))
    extra = sorted(set(residual) - set(names), key=repr)
    if missing or extra:
        raise EncodeError(
            f"the residual must name exactly the tensors: missing {missing}, extra {extra}"
        )
    out: list[torch.Tensor] = []
    for spec, flat in zip(specs, flats, strict=True):
        value = residual[spec.name]
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise EncodeError(f"residual {spec.name!r} is not a floating-point tensor")
        if tuple(value.shape) != spec.shape:
            raise EncodeError(
                f"residual {spec.name!r} has shape {tuple(value.shape)}, the tensor {spec.shape}"
            )
        out.append(compensate_tensor(flat, value.detach().reshape(-1)))
    return out


def _shares_memory(payload: torch.Tensor, flat: torch.Tensor) -> bool:
    return (
        payload.device == flat.device
        and payload.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    )


def _label(slot: ChunkSlot, name: str) -> str:
    return (
        f"chunk {slot.index} (tensor {name!r} elements [{slot.offset}:{slot.offset + slot.count}])"
    )


def _checked_slots(quantized: QuantizedTensors, where: str) -> list[ChunkSlot]:
    """The chunk slots, once every payload is checked to fit its slot."""
    if not isinstance(quantized, QuantizedTensors):
        raise InvalidQuantized(
            f"{where}: expected QuantizedTensors, not {type(quantized).__name__}"
        )
    slots = list(chunk_slots(quantized.specs, quantized.chunk_elements))
    payloads = quantized.payloads
    if not isinstance(payloads, list) or len(payloads) != len(slots):
        count = len(payloads) if isinstance(payloads, list) else type(payloads).__name__
        raise InvalidQuantized(
            f"{where}: payloads: {count} given, the layout has {len(slots)} chunks"
        )
    codec = quantized.codec
    for slot, payload in zip(slots, payloads, strict=True):
        name = quantized.specs[slot.tensor].name
        size = payload_size(codec.scheme, slot.count, codec.block_size)
        if (
            not isinstance(payload, torch.Tensor)
            or payload.dtype != torch.uint8
            or payload.dim() != 1
            or payload.device.type != "cpu"
            or not payload.is_contiguous()
        ):
            raise InvalidQuantized(
                f"{where}: payload {slot.index} must be a contiguous 1-D uint8 CPU tensor"
            )
        if payload.numel() != size:
            raise InvalidQuantized(
                f"{where}: payload {slot.index} holds {payload.numel()} bytes; "
                f"{_label(slot, name)} needs {size}"
            )
    return slots


def _check_values(quantized: QuantizedTensors, slots: Sequence[ChunkSlot], where: str) -> None:
    """Refuse payloads the decoder would refuse: impossible scales, NaN or Inf."""
    block = quantized.codec.block_size
    fp32 = quantized.codec.scheme == "fp32"
    for slot, payload in zip(slots, quantized.payloads, strict=True):
        if not slot.count:
            continue
        label = f"{where}: payload {slot.index}"
        if fp32:
            values = payload.view(torch.float32)
            peak = torch.maximum(values.amax(), values.amin().neg()).item()
            if not peak < float("inf"):
                raise InvalidQuantized(f"{label} holds NaN or Inf")
            continue
        scales = payload[: SCALE_BYTES * num_blocks(slot.count, block)].view(torch.bfloat16)
        low, high = torch.aminmax(scales.float())
        try:
            check_scale_range(low.item(), high.item(), label)
        except CodecError as exc:
            raise InvalidQuantized(str(exc)) from None


def _from_state(state: object, where: str) -> QuantizedTensors:
    if not isinstance(state, dict):
        raise InvalidQuantized(f"{where}: state must be a dict, not {type(state).__name__}")
    missing = sorted(_STATE_KEYS - set(state))
    unknown = sorted(repr(key) for key in set(state) - _STATE_KEYS)
    if missing or unknown:
        raise InvalidQuantized(
            f"{where}: state keys: missing {missing}, unknown [{', '.join(unknown)}]"
        )
    version = state["version"]
    if type(version) is not int or version != _STATE_VERSION:
        raise InvalidQuantized(f"{where}: version {version!r} is not {_STATE_VERSION}")
    codec = _codec(state["codec"], where)
    try:
        chunk_elements = check_chunk_elements(state["chunk_elements"], codec.block_size)
    except CodecError as exc:
        raise InvalidQuantized(f"{where}: {exc}") from None
    specs = _specs(state["tensors"], where)
    sizes = state["payload_sizes"]
    if not isinstance(sizes, list) or not all(type(size) is int and size >= 0 for size in sizes):
        raise InvalidQuantized(f"{where}: payload_sizes must be a list of ints >= 0")
    data = state["payloads"]
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        raise InvalidQuantized(f"{where}: payloads must be a 1-D uint8 tensor")
    if data.numel() != sum(sizes):
        raise InvalidQuantized(
            f"{where}: payloads holds {data.numel()} bytes, payload_sizes add up to {sum(sizes)}"
        )
    # Copies, so each payload starts aligned (fp32 and bfloat16 views need it).
    pieces = torch.split(data.detach().cpu(), sizes) if sizes else ()
    payloads = [piece.clone() for piece in pieces]
    quantized = QuantizedTensors(specs, codec, chunk_elements, payloads)
    slots = _checked_slots(quantized, where)
    _check_values(quantized, slots, where)
    return quantized


def _codec(value: object, where: str) -> CodecParams:
    fields = {field.name for field in dataclasses.fields(CodecParams)}
    if not isinstance(value, dict) or not set(value) <= fields:
        raise InvalidQuantized(f"{where}: codec must be a dict with keys among {sorted(fields)}")
    try:
        return CodecParams(**value)
    except CodecError as exc:
        raise InvalidQuantized(f"{where}: codec: {exc}") from None


def _specs(value: object, where: str) -> list[TensorLayout]:
    if not isinstance(value, list):
        raise InvalidQuantized(f"{where}: tensors must be a list of [name, dtype, shape]")
    specs: list[TensorLayout] = []
    seen: set[str] = set()
    for index, entry in enumerate(value):
        if (
            not isinstance(entry, list | tuple)
            or len(entry) != 3
            or not isinstance(entry[2], list | tuple)
        ):
            raise InvalidQuantized(f"{where}: tensors[{index}] must be [name, dtype, shape]")
        name, dtype, shape = entry
        try:
            spec = TensorLayout(name, dtype, tuple(shape))
        except CodecError as exc:
            raise InvalidQuantized(f"{where}: tensors[{index}]: {exc}") from None
        if spec.name in seen:
            raise InvalidQuantized(f"{where}: tensors[{index}]: name {spec.name!r} repeats")
        seen.add(spec.name)
        specs.append(spec)
    return specs
