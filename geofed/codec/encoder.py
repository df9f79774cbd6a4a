"""Encoding a mapping of named tensors into a framed, self-describing stream.

Two steps, each defined here once: quantizing the chunk slots into payloads
(:func:`quantize_slots`) and framing payloads into a stream (:func:`seal_payloads`).
:func:`encode_stream` chains them chunk by chunk; :mod:`geofed.codec.quantized` runs them
apart, in different processes if need be.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
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

    The same as sealing (:func:`geofed.codec.seal_quantized`) what
    :func:`geofed.codec.quantize_tensors` makes of the tensors, without holding every
    payload at once.
    """
    check_encoding(codec, chunk_elements)
    check_sealing(workers, compression, zstd_threads)
    specs, flats = describe_tensors(tensors)
    with restored_on_failure(generator):
        # One worker seals each payload before the next is quantized: buffers can be reused.
        payloads = quantize_slots(
            specs, flats, codec, chunk_elements, generator=generator, reuse_buffer=workers == 1
        )
        return seal_payloads(
            specs,
            codec,
            chunk_elements,
            payloads,
            workers=workers,
            compression=compression,
            zstd_threads=zstd_threads,
        )


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


def check_encoding(codec: object, chunk_elements: object) -> None:
    """Refuse codec parameters or a chunk size that cannot encode."""
    if not isinstance(codec, CodecParams):
        raise EncodeError(f"codec must be a CodecParams, not {type(codec).__name__}")
    check_chunk_elements(chunk_elements, codec.block_size)


def check_sealing(workers: object, compression: object, zstd_threads: object) -> None:
    """Refuse sealing options out of range."""
    check_policy(compression)
    check_zstd_threads(zstd_threads)
    if not isinstance(workers, int) or not 1 <= workers <= (os.cpu_count() or 1) * 4:
        raise EncodeError(f"workers {workers!r} must be an int from 1 to 4 x the CPU count")


@contextmanager
def restored_on_failure(generator: torch.Generator | None) -> Iterator[None]:
    """Put ``generator`` back in its state on entry if the block raises."""
    state = generator.get_state() if generator is not None else None
    try:
        yield
    except BaseException:
        if generator is not None and state is not None:
            generator.set_state(state)
        raise


def describe_tensors(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[list[TensorLayout], list[torch.Tensor]]:
    """The layout of each tensor and its flattened view; refuses what cannot be encoded."""
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


def quantize_slots(
    specs: Sequence[TensorLayout],
    flats: Sequence[torch.Tensor],
    params: CodecParams,
    chunk_elements: int,
    *,
    generator: torch.Generator | None,
    reuse_buffer: bool,
    residuals: Sequence[torch.Tensor] | None = None,
) -> Iterator[tuple[ChunkSlot, torch.Tensor]]:
    """Yield each chunk's slot and payload (host), quantized in order, lazily.

    With ``reuse_buffer`` a payload is valid until the next one is drawn. ``residuals``
    (flat float32, one per tensor, on its device) receive what decoding will miss.
    """
    codec = BlockCodec(
        params.scheme, params.block_size, stochastic_rounding=params.stochastic_rounding
    )
    for slot in chunk_slots(specs, chunk_elements):
        spec = specs[slot.tensor]
        flat = flats[slot.tensor]
        stop = slot.offset + slot.count
        if generator is not None and generator.device != flat.device:
            raise EncodeError(
                f"tensor {spec.name!r} is on {flat.device} but the generator is on "
                f"{generator.device}"
            )
        # Quantization stays on the caller's thread, in order, so seeded rounding
        # reproduces; compression and hashing, which release the GIL, may run on workers.
        payload = codec.encode(
            flat[slot.offset : stop],
            label=f"tensor {spec.name!r} elements [{slot.offset}:{stop}]",
            generator=generator,
            reuse_buffer=reuse_buffer,
            residual_out=None if residuals is None else residuals[slot.tensor][slot.offset : stop],
        )
        yield slot, payload


def seal_payloads(
    specs: list[TensorLayout],
    params: CodecParams,
    chunk_elements: int,
    payloads: Iterable[tuple[ChunkSlot, torch.Tensor]],
    *,
    workers: int,
    compression: CompressionPolicy,
    zstd_threads: int,
) -> EncodedStream:
    """Frame the payloads of every chunk slot, in order, into a stream.

    The next payload is drawn from ``payloads`` while ``workers`` > 1 threads compress
    and hash the previous ones.
    """
    chunks: list[Chunk] = []

    def collect(slot: ChunkSlot, sealed: Sealed) -> None:
        name = specs[slot.tensor].name
        chunks.append(
            Chunk(sealed.data, sealed.digest.hex(), slot.index, name, slot.offset, slot.count)
        )

    headers: list[Sealed] = []
    trailer = frame_payloads(
        specs,
        params,
        chunk_elements,
        payloads,
        headers.append,
        collect,
        workers=workers,
        compression=compression,
        zstd_threads=zstd_threads,
    )
    (header,) = headers
    return EncodedStream(
        specs=specs,
        codec=params,
        chunk_elements=chunk_elements,
        header=header.data,
        header_digest=header.digest.hex(),
        chunks=chunks,
        trailer=trailer.data,
    )


def frame_payloads(
    specs: list[TensorLayout],
    params: CodecParams,
    chunk_elements: int,
    payloads: Iterable[tuple[ChunkSlot, torch.Tensor]],
    on_header: Callable[[Sealed], None],
    on_chunk: Callable[[ChunkSlot, Sealed], None],
    *,
    workers: int,
    compression: CompressionPolicy,
    zstd_threads: int,
) -> Sealed:
    """Seal the stream of ``payloads``: its header frame goes to ``on_header`` first,
    then each chunk frame to ``on_chunk`` in order, as it is sealed (a caller writing
    them out holds one at a time); returns the trailer frame."""
    header = seal(FrameKind.HEADER, [header_body(params, chunk_elements, specs)])
    on_header(header)
    sealer = ChunkSealer(params, header.digest, policy=compression, zstd_threads=zstd_threads)
    stream_hash = hashlib.sha256(header.digest)
    count, size = 0, len(header.data)

    def collect(slot: ChunkSlot, sealed: Sealed) -> None:
        nonlocal count, size
        stream_hash.update(sealed.digest)
        count, size = count + 1, size + len(sealed.data)
        on_chunk(slot, sealed)

    with Pipeline(workers) as pipeline:
        for slot, payload in payloads:
            pipeline.submit(slot, functools.partial(sealer.seal, slot, payload), collect)
    return seal(
        FrameKind.TRAILER,
        [
            trailer_body(
                TrailerFields(
                    chunk_count=count,
                    total_elements=sum(spec.numel for spec in specs),
                    total_bytes=size,
                    stream_digest=stream_hash.digest(),
                )
            )
        ],
    )
