"""Encoding a mapping of named tensors into a framed, self-describing stream."""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from geofed.codec.compression import CompressionPolicy, check_policy, check_zstd_threads
from geofed.codec.errors import CodecError, EncodeError
from geofed.codec.layout import DEFAULT_CHUNK_ELEMENTS, ChunkSlot, check_chunk_elements, chunk_slots
from geofed.codec.pipeline import ChunkSealer, Pipeline
from geofed.codec.quantize import BlockCodec
from geofed.codec.tensors import DTYPE_NAMES, TensorLayout, check_tensor_name
from geofed.codec.wire import (
    FrameKind,
    Sealed,
    TrailerFields,
    header_body,
    seal,
    trailer_body,
)
from geofed.codec_params import CodecParams, Scheme


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk frame as it goes on the wire.

    ``data`` is the whole frame, ``digest`` the sha256 hex of ``data`` (what a manifest
    records), ``index`` its sequence number, and ``tensor``/``offset``/``count`` the
    slice of the flattened tensor it carries.
    """

    data: bytes
    digest: str
    index: int
    tensor: str
    offset: int
    count: int


@dataclass(frozen=True, slots=True)
class EncodedStream:
    """An encoded stream: its header frame, chunk frames and trailer frame.

    The frames can be sent together (:meth:`to_bytes`) or one by one; a decoder needs
    them in order: header, chunks by index, trailer.
    """

    specs: list[TensorLayout]
    codec: CodecParams
    chunk_elements: int
    header: bytes
    header_digest: str
    chunks: list[Chunk]
    trailer: bytes

    @property
    def digests(self) -> list[str]:
        """The chunks' sha256 digests in order, as a manifest records them."""
        return [chunk.digest for chunk in self.chunks]

    @property
    def total_bytes(self) -> int:
        return len(self.header) + sum(len(chunk.data) for chunk in self.chunks) + len(self.trailer)

    @property
    def fp32_bytes(self) -> int:
        """What the same tensors weigh as raw float32, the reference for ratios."""
        return 4 * sum(spec.numel for spec in self.specs)

    def frames(self) -> Iterator[bytes]:
        yield self.header
        for chunk in self.chunks:
            yield chunk.data
        yield self.trailer

    def to_bytes(self) -> bytes:
        return b"".join(self.frames())


def encode_stream(
    tensors: Mapping[str, torch.Tensor],
    codec: CodecParams,
    *,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    generator: torch.Generator | None = None,
    workers: int = 1,
    compression: CompressionPolicy = "auto",
    zstd_threads: int = 0,
) -> EncodedStream:
    """Encode ``tensors`` (in mapping order) as a stream with ``codec``.

    Each chunk carries ``chunk_elements`` values of one tensor (a multiple of the block
    size; the last chunk of a tensor may be shorter).

    ``compression`` picks which chunks zstd compresses (at ``codec.zstd_level``): ``auto``
    those where it pays (see :mod:`geofed.codec.compression`), ``zstd`` every chunk,
    ``none`` none; each chunk frame records its choice. ``zstd_threads`` >= 1 runs zstd
    in its multi-threaded mode with that many threads (the bytes do not depend on the
    number, but differ from those of the default single-threaded mode, 0).

    Quantization runs on each tensor's own device; only payloads reach the host.
    ``generator`` drives stochastic rounding and must live on the tensors' device; its
    state is restored if encoding fails. ``workers`` > 1 compresses and hashes chunks on
    that many threads while the next chunks are quantized (the bytes are the same).
    Raises :class:`EncodeError` (naming the tensor) on an unsupported dtype, a bad name
    or a non-finite value.
    """
    if not isinstance(codec, CodecParams):
        raise EncodeError(f"codec must be a CodecParams, not {type(codec).__name__}")
    check_chunk_elements(chunk_elements, codec.block_size)
    check_policy(compression)
    check_zstd_threads(zstd_threads)
    if not isinstance(workers, int) or not 1 <= workers <= (os.cpu_count() or 1) * 4:
        raise EncodeError(f"workers {workers!r} must be an int from 1 to 4 x the CPU count")
    specs, flats = _describe(tensors)
    rng_state = generator.get_state() if generator is not None else None
    try:
        return _encode(
            specs, flats, codec, chunk_elements, generator, workers, compression, zstd_threads
        )
    except BaseException:
        if generator is not None and rng_state is not None:
            generator.set_state(rng_state)
        raise


def encode(
    tensors: Mapping[str, torch.Tensor],
    *,
    scheme: Scheme = "int8",
    block_size: int = 128,
    zstd_level: int = 1,
    stochastic_rounding: bool = False,
    generator: torch.Generator | None = None,
    compression: CompressionPolicy = "auto",
) -> bytes:
    """Encode ``tensors`` into one contiguous stream (header, chunks, trailer)."""
    codec = CodecParams(
        scheme=scheme,
        block_size=block_size,
        zstd_level=zstd_level,
        stochastic_rounding=stochastic_rounding,
    )
    return encode_stream(tensors, codec, generator=generator, compression=compression).to_bytes()


def _describe(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[list[TensorLayout], list[torch.Tensor]]:
    if not isinstance(tensors, Mapping):
        raise EncodeError(
            f"tensors must be a mapping of name to tensor, not {type(tensors).__name__}"
        )
    specs: list[TensorLayout] = []
    flats: list[torch.Tensor] = []
    for name, tensor in tensors.items():
        try:
            check_tensor_name(name)
        except CodecError as exc:
            raise EncodeError(str(exc)) from exc
        if not isinstance(tensor, torch.Tensor):
            raise EncodeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            raise EncodeError(
                f"tensor {name!r} is {tensor.layout} on {tensor.device}; "
                "only dense tensors holding data can be encoded"
            )
        dtype = DTYPE_NAMES.get(tensor.dtype)
        if dtype is None:
            raise EncodeError(
                f"tensor {name!r} has dtype {tensor.dtype}; supported: "
                + ", ".join(str(d) for d in DTYPE_NAMES)
            )
        specs.append(TensorLayout(name, dtype, tuple(tensor.shape)))
        flats.append(tensor.detach().reshape(-1))
    return specs, flats


def _encode(
    specs: list[TensorLayout],
    flats: list[torch.Tensor],
    params: CodecParams,
    chunk_elements: int,
    generator: torch.Generator | None,
    workers: int,
    compression: CompressionPolicy,
    zstd_threads: int,
) -> EncodedStream:
    header = seal(FrameKind.HEADER, [header_body(params, chunk_elements, specs)])
    codec = BlockCodec(
        params.scheme, params.block_size, stochastic_rounding=params.stochastic_rounding
    )
    sealer = ChunkSealer(params, header.digest, policy=compression, zstd_threads=zstd_threads)
    stream_hash = hashlib.sha256(header.digest)
    chunks: list[Chunk] = []

    def collect(slot: ChunkSlot, sealed: Sealed) -> None:
        stream_hash.update(sealed.digest)
        name = specs[slot.tensor].name
        chunks.append(
            Chunk(sealed.data, sealed.digest.hex(), slot.index, name, slot.offset, slot.count)
        )

    with Pipeline(workers) as pipeline:
        for slot in chunk_slots(specs, chunk_elements):
            spec = specs[slot.tensor]
            flat = flats[slot.tensor]
            label = f"tensor {spec.name!r} elements [{slot.offset}:{slot.offset + slot.count}]"
            if generator is not None and generator.device != flat.device:
                raise EncodeError(
                    f"tensor {spec.name!r} is on {flat.device} but the generator is on "
                    f"{generator.device}"
                )
            # Quantization stays on this thread (in order, so seeded rounding reproduces);
            # compression and hashing, which release the GIL, may run on workers.
            payload = codec.encode(
                flat[slot.offset : slot.offset + slot.count],
                label=label,
                generator=generator,
                reuse_buffer=workers == 1,
            )
            pipeline.submit(slot, functools.partial(sealer.seal, slot, payload), collect)
    trailer = seal(
        FrameKind.TRAILER,
        [
            trailer_body(
                TrailerFields(
                    chunk_count=len(chunks),
                    total_elements=sum(spec.numel for spec in specs),
                    total_bytes=len(header.data) + sum(len(chunk.data) for chunk in chunks),
                    stream_digest=stream_hash.digest(),
                )
            )
        ],
    )
    return EncodedStream(
        specs=specs,
        codec=params,
        chunk_elements=chunk_elements,
        header=header.data,
        header_digest=header.digest.hex(),
        chunks=chunks,
        trailer=trailer.data,
    )
