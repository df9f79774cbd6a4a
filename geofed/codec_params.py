"""The codec parameters: how a job's deltas and updates are encoded, defined once.

One model serves every party that names them: the job spec (its ``codec`` section), the
round announcement, the signed manifest and the codec itself (:mod:`geofed.codec`). Its
bounds are defined here and nowhere else. The module imports neither torch nor the codec,
so control messages and manifests validate codec parameters without loading either; the
codec's base error lives here for the same reason.

Two ways in, one set of rules:

- built directly (``CodecParams(scheme="int4")``), the parameters are checked at
  construction and a bad value raises :class:`InvalidConfig`;
- validated by pydantic (a field of a job spec, an announcement or a manifest), input is
  strict (no coercion), unknown keys are refused and each error names its field. These
  records name zstd's regular levels only (1-22); the fast (negative) levels stay
  available to the codec's direct callers, for local experiments.

The wire form is a JSON object with the four fields below, in this order; a missing field
takes its default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

from pydantic import GetCoreSchemaHandler
from pydantic_core import CoreSchema, core_schema

__all__ = [
    "MAX_BLOCK_SIZE",
    "MAX_ZSTD_LEVEL",
    "MIN_BLOCK_SIZE",
    "MIN_RECORDED_ZSTD_LEVEL",
    "MIN_ZSTD_LEVEL",
    "SCHEMES",
    "CodecError",
    "CodecParams",
    "InvalidConfig",
    "Scheme",
    "check_int",
]

Scheme = Literal["fp32", "int8", "int4"]

SCHEMES: Final[tuple[str, ...]] = get_args(Scheme)
MIN_BLOCK_SIZE: Final = 2
MAX_BLOCK_SIZE: Final = 1 << 16
#: zstd's fast levels are negative; the codec accepts them.
MIN_ZSTD_LEVEL: Final = -(1 << 17)
MAX_ZSTD_LEVEL: Final = 22
#: Job specs, announcements and manifests name one of zstd's regular levels.
MIN_RECORDED_ZSTD_LEVEL: Final = 1


class CodecError(Exception):
    """Base class of every codec error."""


class InvalidConfig(CodecError, ValueError):
    """A codec parameter or tensor description is out of range."""


@dataclass(frozen=True, slots=True)
class CodecParams:
    """How a delta or an update is encoded.

    Attributes:
        scheme: ``fp32`` (lossless reference), ``int8`` or ``int4`` (blockwise absmax).
        block_size: elements sharing one scale; even, so int4 pairs never straddle blocks.
        zstd_level: zstd level of the chunks the encoder compresses (negative levels are
            zstd's fast modes); by default it compresses only those where zstd pays
            (:mod:`geofed.codec.compression`), and each chunk frame says which it is.
        stochastic_rounding: round up with probability equal to the fraction instead of
            to nearest (unbiased, at most one step of error); int8/int4 only.
    """

    scheme: Scheme = "int8"
    block_size: int = 128
    zstd_level: int = 1
    stochastic_rounding: bool = False

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise InvalidConfig(f"scheme {self.scheme!r} is not one of {', '.join(SCHEMES)}")
        check_int("block_size", self.block_size, MIN_BLOCK_SIZE, MAX_BLOCK_SIZE)
        _even_block_size(self.block_size)
        check_int("zstd_level", self.zstd_level, MIN_ZSTD_LEVEL, MAX_ZSTD_LEVEL)
        if not isinstance(self.stochastic_rounding, bool):
            raise InvalidConfig(
                f"stochastic_rounding must be a bool, not {type(self.stochastic_rounding).__name__}"
            )
        if self.stochastic_rounding and self.scheme == "fp32":
            raise InvalidConfig("stochastic_rounding applies to int8 and int4, not fp32")

    def rounding_to_nearest(self) -> CodecParams:
        """The same parameters without stochastic rounding: an encoding that reproduces."""
        return dataclasses.replace(self, stochastic_rounding=False)

    def as_dict(self) -> dict[str, Any]:
        """The wire form (field order kept)."""
        return dataclasses.asdict(self)

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: type[Any], handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return _pydantic_schema()


def check_int(what: str, value: object, low: int, high: int) -> int:
    """Return ``value`` if it is an int (not a bool) in ``[low, high]``, else raise."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidConfig(f"{what} must be an int, not {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidConfig(f"{what} {value} is outside [{low}, {high}]")
    return value


def _even_block_size(value: int) -> int:
    if value % 2:
        raise InvalidConfig(f"block_size {value} must be even")
    return value


def _pydantic_schema() -> CoreSchema:
    """Strict field-by-field validation (errors located at the field), then construction."""

    def field(schema: CoreSchema) -> core_schema.TypedDictField:
        return core_schema.typed_dict_field(schema, required=False)

    fields = core_schema.typed_dict_schema(
        {
            "scheme": field(core_schema.literal_schema(list(SCHEMES))),
            "block_size": field(
                core_schema.no_info_after_validator_function(
                    _even_block_size,
                    core_schema.int_schema(ge=MIN_BLOCK_SIZE, le=MAX_BLOCK_SIZE, strict=True),
                )
            ),
            "zstd_level": field(
                core_schema.int_schema(ge=MIN_RECORDED_ZSTD_LEVEL, le=MAX_ZSTD_LEVEL, strict=True)
            ),
            "stochastic_rounding": field(core_schema.bool_schema(strict=True)),
        },
        extra_behavior="forbid",
    )
    build = core_schema.no_info_after_validator_function(_build, fields)
    return core_schema.json_or_python_schema(
        json_schema=build,
        # An instance is checked like its wire form, so a record never holds parameters
        # that it would refuse to read back.
        python_schema=core_schema.no_info_before_validator_function(_unbuild, build),
        serialization=core_schema.plain_serializer_function_ser_schema(
            CodecParams.as_dict, return_schema=fields
        ),
    )


def _build(fields: dict[str, Any]) -> CodecParams:
    return CodecParams(**fields)


def _unbuild(value: object) -> object:
    return value.as_dict() if isinstance(value, CodecParams) else value
