"""The tensors of a stream: names, dtypes and shapes, validated once at construction.

The codec parameters (scheme, block size, zstd level, rounding) are
:class:`geofed.codec_params.CodecParams`; how tensors are cut into chunks is
:mod:`geofed.codec.layout`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal

import torch

from geofed.codec_params import InvalidConfig

DTypeName = Literal["float32", "float16", "bfloat16"]

DTYPES: Final[dict[DTypeName, torch.dtype]] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_NAMES: Final[dict[torch.dtype, DTypeName]] = {dtype: name for name, dtype in DTYPES.items()}

MAX_NAME_BYTES: Final = 1024
MAX_NDIM: Final = 64
# Element counts stay far below 2**63 so offsets and byte sizes never overflow a u64.
MAX_NUMEL: Final = 1 << 56


@dataclass(frozen=True, slots=True)
class TensorLayout:
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
