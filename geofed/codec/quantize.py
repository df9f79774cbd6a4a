"""Blockwise absmax quantization of flat tensor slices into chunk payloads, and back.

Math only: tensors in, tensors out, no framing. A slice is cut into blocks of
``block_size`` elements; each block gets one scale ``s`` (a bfloat16 rounded *up* from
``absmax / qmax``, at least 2**-120) and each element the integer code
``q = round(x / s)`` (or ``floor(x / s + u)``, ``u ~ U[0, 1)``, with stochastic rounding),
``qmax`` = 127 (int8) or 7 (int4). Decoding computes ``q * s`` in float32, which is exact
(``q`` has at most 8 significant bits and ``s`` 8), so every decoder on every machine gets
the same bits.

bfloat16 rather than float16 scales: float16 underflows for the small blocks typical of
late-training deltas (absmax/127 below 6e-8) and overflows above 8e6; bfloat16 has
float32's range at the same two bytes. Rounding the scale up keeps every code within
``[-qmax, qmax]``.

Speed: a handful of in-place ops on reused buffers, on the slice's own device; only the
finished payload (scales and codes) is copied to the host. On the CPU they run on the
calling thread alone (:mod:`geofed.codec.host_threads`; parallelism comes from chunks
processed side by side), and the passes over the elements run in tiles of
``tile_elements`` (128K: 512 KiB of float32, so that the rounding and packing passes
work in cache, not memory) while the per-block scale math runs once per slice, since
eager per-op overhead (a few us) outweighs the arithmetic on small tiles: on a 2-core
Xeon, 128K tiles quantized about 1.3x faster than whole 1M-element chunks and 32K tiles
1.4x slower. A torch.compile'd kernel was about 1.3x faster than
these ops but took 24 s to compile and needs a C++ compiler at run time. Slices of at
most ``SMALL_ELEMENTS`` (biases, norms) go through a numpy twin of the same arithmetic,
whose per-call overhead is about half of torch's; the two give the same bytes and
values (tested).

Error feedback needs ``x - q * s``, what decoding will miss. The encoder can write it
(``residual_out``) from the codes and scales it already holds, on the slice's device, so
no payload has to be decoded on the host; since ``q * s`` is exact, the residual has the
same bits as ``x`` minus the host decoder's values.
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np
import torch

from geofed.codec.errors import CorruptChunk, EncodeError, NonFiniteValue
from geofed.codec.host_threads import one_thread
from geofed.codec.layout import SCALE_BYTES, num_blocks, payload_size
from geofed.codec_params import Scheme

TILE_ELEMENTS: Final = 1 << 17
#: CPU float32 slices up to this size are quantized with numpy, whose per-call overhead is
#: a fraction of torch's (biases and norms of a model are all this small).
SMALL_ELEMENTS: Final = 1 << 13
MIN_SCALE: Final = 2.0**-120
# q * s must stay finite in float32 for |q| <= 127.
MAX_SCALE: Final = 2.0**120
QMAX: Final[dict[str, int]] = {"int8": 127, "int4": 7}
_INT4_OFFSET: Final = 8
_BF16_CEIL_ADD: Final = 0xFFFF
_BF16_MASK: Final = -(1 << 16)


class BlockCodec:
    """Quantizes slices into payloads and back for one scheme; reuses its buffers."""

    def __init__(
        self,
        scheme: Scheme,
        block_size: int,
        *,
        stochastic_rounding: bool = False,
        tile_elements: int = TILE_ELEMENTS,
        small_elements: int = SMALL_ELEMENTS,
    ) -> None:
        self.scheme: Scheme = scheme
        self.block_size = block_size
        self.stochastic_rounding = stochastic_rounding
        self.tile = max(block_size, tile_elements // block_size * block_size)
        #: CPU float32 slices up to this size take the numpy path (0: never).
        self.small_elements = small_elements
        self._buffers: dict[tuple[str, torch.device], torch.Tensor] = {}

    # -- encoding -------------------------------------------------------------------

    def encode(
        self,
        flat: torch.Tensor,
        *,
        label: str,
        generator: torch.Generator | None = None,
        reuse_buffer: bool = True,
        residual_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return the payload (uint8, on the host) of a 1-D contiguous float slice.

        With ``reuse_buffer`` the payload may be a buffer this codec reuses: consume it
        before the next call. An fp32 payload may share memory with ``flat``.
        ``residual_out`` (1-D float32, as many elements as ``flat``, on its device), when
        given, receives ``flat - decoded`` (zeros for fp32), bit for bit what subtracting
        the decoder's values gives.
        Raises :class:`NonFiniteValue` on NaN/Inf and :class:`EncodeError` on magnitudes
        too large to quantize, naming ``label`` and the first offending element.
        """
        if flat.device.type != "cpu":
            return self._encode(flat, label, generator, reuse_buffer, residual_out)
        with one_thread():
            return self._encode(flat, label, generator, reuse_buffer, residual_out)

    def _encode(
        self,
        flat: torch.Tensor,
        label: str,
        generator: torch.Generator | None,
        reuse_buffer: bool,
        residual_out: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.scheme == "fp32":
            payload = self._encode_fp32(flat, label)
            if residual_out is not None:
                residual_out.zero_()
            return payload
        count = flat.numel()
        nblocks = num_blocks(count, self.block_size)
        size = payload_size(self.scheme, count, self.block_size)
        if reuse_buffer:
            payload = self._buffer("payload", size, flat.device, torch.uint8)
        else:
            payload = torch.empty(size, dtype=torch.uint8, device=flat.device)
        scales = payload[: SCALE_BYTES * nblocks].view(torch.bfloat16)
        codes = payload[SCALE_BYTES * nblocks :]
        if self.scheme == "int8":
            codes = codes.view(torch.int8)
        if (
            count <= self.small_elements
            and flat.device.type == "cpu"
            and flat.dtype == torch.float32
            and not self.stochastic_rounding
        ):
            peak = _quantize_small(
                flat.numpy(),
                payload.numpy(),
                self.scheme,
                self.block_size,
                None if residual_out is None else residual_out.numpy(),
            )
            if not math.isfinite(peak) or peak > MAX_SCALE:
                raise _bad_value_error(flat, label)
            return payload
        block = self.block_size
        full = count // block * block
        if full:
            self._quantize_blocks(
                flat[:full].view(-1, block),
                scales[: full // block],
                self._code_slice(codes, 0, full),
                generator,
                None if residual_out is None else residual_out[:full].view(-1, block),
            )
        if full < count:
            self._quantize_tail(
                flat[full:],
                scales[-1:],
                codes[full if self.scheme == "int8" else full // 2 :],
                generator,
                None if residual_out is None else residual_out[full:],
            )
        peak = scales.max().item() if nblocks else 0.0
        if not math.isfinite(peak) or peak > MAX_SCALE:
            raise _bad_value_error(flat, label)
        return payload.cpu()

    def _quantize_tail(
        self,
        tail: torch.Tensor,
        scale_out: torch.Tensor,
        codes_out: torch.Tensor,
        generator: torch.Generator | None,
        residual_out: torch.Tensor | None,
    ) -> None:
        """Quantize a last, partial block through a zero-padded copy of it."""
        block = self.block_size
        padded = self._buffer("pad", block, tail.device)
        padded.zero_()
        padded[: tail.numel()].copy_(tail)
        code_bytes = block if self.scheme == "int8" else block // 2
        tail_codes = self._buffer("tail", code_bytes, tail.device, torch.uint8).view(
            codes_out.dtype
        )
        tail_residual = None
        if residual_out is not None:
            tail_residual = self._buffer("tail_residual", block, tail.device).view(1, block)
        self._quantize_blocks(
            padded.view(1, block), scale_out, tail_codes, generator, tail_residual
        )
        codes_out.copy_(tail_codes[: codes_out.numel()])
        if residual_out is not None and tail_residual is not None:
            residual_out.copy_(tail_residual.view(-1)[: tail.numel()])

    def _encode_fp32(self, flat: torch.Tensor, label: str) -> torch.Tensor:
        values = flat.to(torch.float32)
        if values.numel():
            peak = torch.maximum(values.amax(), values.amin().neg()).item()
            if not math.isfinite(peak):
                raise _bad_value_error(flat, label)
        return values.cpu().view(torch.uint8)

    def _code_slice(self, codes: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        if self.scheme == "int8":
            return codes[start:stop]
        return codes[start // 2 : stop // 2]

    def _quantize_blocks(
        self,
        blocks: torch.Tensor,
        scales_out: torch.Tensor,
        codes_out: torch.Tensor,
        generator: torch.Generator | None,
        residual_out: torch.Tensor | None = None,
    ) -> None:
        """Quantize whole blocks: block maxima tile by tile, all scales at once, then codes.

        Per-op overhead, not arithmetic, bounds small tiles: the scale math runs once per
        slice on its ``nblocks`` values, and only the passes over the elements are tiled.
        """
        nblocks, block = blocks.shape
        device = blocks.device
        if blocks.dtype != torch.float32:
            converted = self._buffer("convert", nblocks * block, device).view(nblocks, block)
            converted.copy_(blocks)
            blocks = converted
        # On an accelerator, launches cost more than cache misses: one tile per slice.
        step = max(1, self.tile // block) if device.type == "cpu" else nblocks
        scale = self._buffer("scale", nblocks, device)
        inverse = self._buffer("inverse", nblocks, device)
        for first in range(0, nblocks, step):
            last = min(first + step, nblocks)
            torch.amax(blocks[first:last], dim=1, out=scale[first:last])
            torch.amin(blocks[first:last], dim=1, out=inverse[first:last])
        qmax = QMAX[self.scheme]
        torch.maximum(scale, inverse.neg_(), out=scale)
        scale.div_(qmax)
        # Round up onto the bfloat16 grid (valid for the non-negative floats here).
        scale.view(torch.int32).add_(_BF16_CEIL_ADD).bitwise_and_(_BF16_MASK)
        scale.clamp_(min=MIN_SCALE)
        scales_out.copy_(scale)
        torch.reciprocal(scale, out=inverse)
        for first in range(0, nblocks, step):
            last = min(first + step, nblocks)
            self._round_codes(
                blocks[first:last],
                inverse[first:last],
                self._code_slice(codes_out, first * block, last * block),
                generator,
                scale[first:last],
                None if residual_out is None else residual_out[first:last],
            )

    def _round_codes(
        self,
        blocks: torch.Tensor,
        inverse: torch.Tensor,
        codes_out: torch.Tensor,
        generator: torch.Generator | None,
        scale: torch.Tensor,
        residual_out: torch.Tensor | None,
    ) -> None:
        nblocks, block = blocks.shape
        device = blocks.device
        qmax = QMAX[self.scheme]
        values = self._buffer("values", nblocks * block, device).view(nblocks, block)
        torch.mul(blocks, inverse[:, None], out=values)
        if self.stochastic_rounding:
            noise = self._buffer("noise", nblocks * block, device)
            torch.rand(noise.shape, generator=generator, device=device, out=noise)
            values.add_(noise.view(nblocks, block)).floor_().clamp_(-qmax, qmax)
        else:
            # |x * (1/s)| <= qmax * (1 + 3 * 2**-24) < qmax + 0.5: no clamp needed.
            values.round_()
        if self.scheme == "int8":
            codes_out.view(nblocks, block).copy_(values)
        else:
            # Byte = (lo + 8) | (hi + 8) << 4 = lo + 16 * hi + 136, exact in float32.
            pairs = values.view(-1, 2)
            packed = self._buffer("packed", pairs.shape[0], device)
            torch.add(pairs[:, 0], pairs[:, 1], alpha=16, out=packed)
            packed.add_(_INT4_OFFSET * 17)
            codes_out.copy_(packed)
        if residual_out is not None:
            # q * s is exact; adding +0 turns the -0 of a code rounded from a small negative
            # into the +0 the decoder makes of code 0, so a zero residual has the sign that
            # subtracting the decoder's values gives.
            values.mul_(scale[:, None]).add_(0.0)
            torch.sub(blocks, values, out=residual_out)

    # -- decoding -------------------------------------------------------------------

    def decode(
        self,
        payload: torch.Tensor,
        count: int,
        *,
        label: str,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return the float32 values (1-D, CPU) of a payload holding ``count`` elements.

        The values are written into ``out`` (1-D, float32, ``count`` elements) when given.
        The payload's size must already be checked against :func:`payload_size`.
        Raises :class:`CorruptChunk` naming ``label`` on a non-finite value or a scale out
        of range.
        """
        with one_thread():
            return self._decode(payload, count, label, out)

    def _decode(
        self, payload: torch.Tensor, count: int, label: str, out: torch.Tensor | None
    ) -> torch.Tensor:
        if self.scheme == "fp32":
            values = payload.view(torch.float32)
            if count and not math.isfinite(
                torch.maximum(values.amax(), values.amin().neg()).item()
            ):
                raise CorruptChunk(f"{label}: payload holds NaN or Inf")
            return values if out is None else out.copy_(values)
        block = self.block_size
        if count <= self.small_elements and (out is None or out.is_contiguous()):
            if out is None:
                out = torch.empty(count, dtype=torch.float32)
            _dequantize_small(payload.numpy(), out.numpy(), self.scheme, block, label)
            return out
        nblocks = num_blocks(count, block)
        scales = payload[: SCALE_BYTES * nblocks].view(torch.bfloat16).to(torch.float32)
        codes = payload[SCALE_BYTES * nblocks :]
        # The encoder's scales lie in [2**-120, 2**120]: products q * s are then normal
        # floats, exact and identical whatever the decoder's denormal handling.
        low, high = torch.aminmax(scales)
        check_scale_range(low.item(), high.item(), label)
        if out is None:
            out = torch.empty(count, dtype=torch.float32)
        for start in range(0, count, self.tile):
            stop = min(start + self.tile, count)
            self._dequantize(codes, scales, out, start, stop)
        return out

    def _dequantize(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        out: torch.Tensor,
        start: int,
        stop: int,
    ) -> None:
        block = self.block_size
        target = out[start:stop]
        if self.scheme == "int8":
            target.copy_(codes[start:stop].view(torch.int8))
        else:
            packed = codes[start // 2 : (stop + 1) // 2]
            pairs = self._buffer("pairs", packed.numel(), torch.device("cpu"), torch.int16)
            shifted = self._buffer("shifted", packed.numel(), torch.device("cpu"), torch.int16)
            pairs.copy_(packed)
            torch.bitwise_left_shift(pairs, 4, out=shifted)
            # Little-endian int16 (hi << 8 | lo): its two bytes are the two nibbles in order.
            pairs.bitwise_or_(shifted).bitwise_and_(0x0F0F)
            target.copy_(pairs.view(torch.uint8)[: stop - start])
            target.sub_(_INT4_OFFSET)
        full = (stop - start) // block * block
        first = start // block
        if full:
            target[:full].view(-1, block).mul_(scales[first : first + full // block, None])
        if full < stop - start:
            target[full:].mul_(scales[first + full // block])

    def _buffer(
        self, role: str, size: int, device: torch.device, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        key = (role, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < size or buffer.dtype != dtype:
            buffer = torch.empty(size, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:size]


def _quantize_small(
    values: np.ndarray,
    payload: np.ndarray,
    scheme: Scheme,
    block: int,
    residual: np.ndarray | None = None,
) -> float:
    """The numpy twin of :meth:`BlockCodec.encode` (rounding to nearest): same bytes.

    Writes the payload of ``values`` (float32) into ``payload`` (uint8, of the payload's
    size), and ``values - decoded`` into ``residual`` when given; returns the largest
    scale, which the caller checks.
    """
    count = values.size
    nblocks = num_blocks(count, block)
    if count % block:
        padded = np.zeros(nblocks * block, dtype=np.float32)
        padded[:count] = values
        values = padded
    blocks = values.reshape(nblocks, block)
    qmax = np.float32(QMAX[scheme])
    scale = np.maximum(blocks.max(axis=1), -blocks.min(axis=1))
    scale /= qmax
    bits = scale.view(np.int32)
    bits += _BF16_CEIL_ADD
    bits &= _BF16_MASK
    np.maximum(scale, np.float32(MIN_SCALE), out=scale)
    peak = float(scale.max())
    if not math.isfinite(peak) or peak > MAX_SCALE:
        return peak  # refused by the caller; codes of such scales would be NaN
    # The scales are on the bfloat16 grid: a bfloat16 is the high half of the float32.
    payload[: SCALE_BYTES * nblocks].view(np.uint16)[:] = scale.view(np.uint32) >> 16
    codes = blocks * (np.float32(1) / scale)[:, None]
    np.rint(codes, out=codes)
    out = payload[SCALE_BYTES * nblocks :]
    if scheme == "int8":
        out.view(np.int8)[:] = codes.reshape(-1)[:count]
    else:
        pairs = codes.reshape(-1, 2)
        packed = pairs[:, 0] + pairs[:, 1] * np.float32(16) + np.float32(_INT4_OFFSET * 17)
        out[:] = packed[: out.size]
    if residual is not None:
        # As in BlockCodec._round_codes: exact products, -0 codes made +0.
        codes *= scale[:, None]
        codes += np.float32(0)
        np.subtract(blocks, codes, out=codes)
        residual[:] = codes.reshape(-1)[:count]
    return peak


def check_scale_range(low: float, high: float, label: str) -> None:
    if not (low >= MIN_SCALE and high <= MAX_SCALE):
        # With finite scales every q * s is finite: a NaN or Inf value can only come
        # from a scale, and receivers report those apart from other corruption.
        finite = math.isfinite(low) and math.isfinite(high)
        raise CorruptChunk(
            f"{label}: block scales must lie in [2**-120, 2**120], "
            f"found [{low}, {high}]" + ("" if finite else ": NaN or Inf")
        )


def _dequantize_small(
    payload: np.ndarray, out: np.ndarray, scheme: Scheme, block: int, label: str
) -> None:
    """The numpy twin of :meth:`BlockCodec.decode` for int8/int4: the same values."""
    count = out.size
    nblocks = num_blocks(count, block)
    bits = payload[: SCALE_BYTES * nblocks].view(np.uint16).astype(np.uint32) << 16
    scales = bits.view(np.float32)
    check_scale_range(float(scales.min()), float(scales.max()), label)
    body = payload[SCALE_BYTES * nblocks :]
    if scheme == "int8":
        codes = body.view(np.int8)
    else:
        codes = np.empty(2 * body.size, dtype=np.int8)
        codes[0::2] = body & 0x0F
        codes[1::2] = body >> 4
        codes -= _INT4_OFFSET
    # q * s is exact in float32 (8 significant bits each), whatever the arithmetic's width.
    full = count // block * block
    if full:
        np.multiply(
            codes[:full].reshape(-1, block),
            scales[: full // block, None],
            out=out[:full].reshape(-1, block),
        )
    if full < count:
        np.multiply(codes[full:count], scales[-1:], out=out[full:])


def _bad_value_error(flat: torch.Tensor, label: str) -> EncodeError:
    """Describe the first element that cannot be encoded (slow path, errors only)."""
    values = flat.to(torch.float32)
    bad = (~torch.isfinite(values)).nonzero()
    if bad.numel():
        index = int(bad[0, 0].item())
        return NonFiniteValue(
            f"{label}: element {index} is {values[index].item()}; a delta must be finite"
        )
    index = int(values.abs().argmax().item())
    return EncodeError(
        f"{label}: element {index} = {values[index].item():.3e} is too large to quantize "
        f"(|x| must stay below {MAX_SCALE:.3e} * qmax)"
    )
