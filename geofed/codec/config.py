"""Codec parameters and tensor descriptions, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal, get_args

import torch

from geofed.codec.errors import InvalidConfig

Scheme = Literal["fp32", "int8", "int4"]
DTypeName = Literal["float32", "float16", "bfloat16"]

SCHEMES: Final[tuple[str, ...]] = get_args(Scheme)
DTYPES: Final[dict[DTypeName, torch.dtype]] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_NAMES: Final[dict[torch.dtype, DTypeName]] = {dtype: name for name, dtype in DTYPES.items()}

DEFAULT_CHUNK_ELEMENTS: Final = 1 << 20
MAX_CHUNK_ELEMENTS: Final = 1 << 28
MAX_BLOCK_SIZE: Final = 1 << 16
MIN_ZSTD_LEVEL: Final = -(1 << 17)
MAX_ZSTD_LEVEL: Final = 22
MAX_NAME_BYTES: Final = 1024
MAX_NDIM: Final = 64
# Element counts stay far below 2**63 so offsets and byte sizes never overflow a u64.
MAX_NUMEL: Final = 1 << 56


@dataclass(frozen=True, slots=True)
class CodecConfig:
    """How a delta is encoded.

    Attributes:
        scheme: ``fp32`` (lossless reference), ``int8`` or ``int4`` (blockwise absmax).
        block_size: elements sharing one scale; even, so int4 pairs never straddle blocks.
        zstd_level: zstd level of every chunk (negative levels are zstd's fast modes).
        stochastic_rounding: round up with probability equal to the fraction instead of
            to nearest (unbiased, at most one step of error); int8/int4 only.
        chunk_elements: elements per chunk frame, a multiple of ``block_size``.
    """

    scheme: Scheme = "int8"
    block_size: int = 128
    zstd_level: int = 1
    stochastic_rounding: bool = False
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise InvalidConfig(f"scheme {self.scheme!r} is not one of {', '.join(SCHEMES)}")
        _check_int("block_size", self.block_size, 2, MAX_BLOCK_SIZE)
        if self.block_size % 2:
            raise InvalidConfig(f"block_size {self.block_size} must be even")
        _check_int("zstd_level", self.zstd_level, MIN_ZSTD_LEVEL, MAX_ZSTD_LEVEL)
        if not isinstance(self.stochastic_rounding, bool):
            raise InvalidConfig(
                f"stochastic_rounding must be a bool, not {type(self.stochastic_rounding).__name__}"
            )
        if self.stochastic_rounding and self.scheme == "fp32":
            raise InvalidConfig("stochastic_rounding applies to int8 and int4, not fp32")
        _check_int("chunk_elements", self.chunk_elements, self.block_size, MAX_CHUNK_ELEMENTS)
        if self.chunk_elements % self.block_size:
            nearest = max(self.block_size, self.chunk_elements // self.block_size * self.block_size)
            raise InvalidConfig(
                f"chunk_elements {self.chunk_elements} is not a multiple of block_size "
                f"{self.block_size}; use e.g. {nearest}"
            )


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, dtype and shape of one tensor of a stream."""

    name: str
    dtype: DTypeName
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        check_tensor_name(self.name)
        # Parsed headers are untrusted JSON: an unhashable dtype must not escape as TypeError.
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise InvalidConfig(
                f"tensor {self.name!r}: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}"
            )
        if not isinstance(self.shape, tuple) or len(self.shape) > MAX_NDIM:
            raise InvalidConfig(
                f"tensor {self.name!r}: shape must be a tuple of at most {MAX_NDIM} sizes"
            )
        for size in self.shape:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InvalidConfig(
                    f"tensor {self.name!r}: shape {self.shape!r} has a size that is not an int >= 0"
                )
        if math.prod(self.shape) > MAX_NUMEL:
            raise InvalidConfig(
                f"tensor {self.name!r}: shape {self.shape!r} has more than {MAX_NUMEL} elements"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def check_tensor_name(name: object) -> str:
    """Return ``name`` if it is a usable tensor name, else raise :class:`InvalidConfig`."""
    if not isinstance(name, str) or not name:
        raise InvalidConfig(f"tensor name {name!r} must be a non-empty string")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidConfig(f"tensor name {name!r} is not valid Unicode text") from exc
    if len(encoded) > MAX_NAME_BYTES:
        raise InvalidConfig(f"tensor name {name[:40]!r}... is longer than {MAX_NAME_BYTES} bytes")
    return name


def _check_int(what: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidConfig(f"{what} must be an int, not {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidConfig(f"{what} {value} is outside [{low}, {high}]")
