"""CodecParams, chunk size and TensorLayout validation."""

from __future__ import annotations

from typing import Any

import pytest

from geofed.codec import DEFAULT_CHUNK_ELEMENTS, InvalidConfig, TensorLayout
from geofed.codec.layout import check_chunk_elements
from geofed.codec_params import CodecParams


def codec_and_chunks(chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, **params: Any) -> None:
    """Validate codec parameters and a chunk size as the encoder does."""
    check_chunk_elements(chunk_elements, CodecParams(**params).block_size)


def test_defaults_are_int8_block_128_level_1() -> None:
    config = CodecParams()
    assert (config.scheme, config.block_size, config.zstd_level) == ("int8", 128, 1)
    assert DEFAULT_CHUNK_ELEMENTS == 1 << 20
    assert DEFAULT_CHUNK_ELEMENTS % config.block_size == 0
    assert config.stochastic_rounding is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scheme": "int2"}, "scheme 'int2' is not one of fp32, int8, int4"),
        ({"block_size": 0}, "block_size 0 is outside [2, 65536]"),
        ({"block_size": 127}, "block_size 127 must be even"),
        ({"block_size": 128.0}, "block_size must be an int, not float"),
        ({"block_size": True}, "block_size must be an int, not bool"),
        ({"zstd_level": 23}, "zstd_level 23 is outside"),
        ({"stochastic_rounding": 1}, "stochastic_rounding must be a bool"),
        ({"scheme": "fp32", "stochastic_rounding": True}, "applies to int8 and int4, not fp32"),
        ({"chunk_elements": 64}, "chunk_elements 64 is outside [128,"),
        ({"chunk_elements": 1 << 29}, "is outside"),
        (
            {"block_size": 96},
            "chunk_elements 1048576 is not a multiple of block_size 96; use e.g. 1048512",
        ),
    ],
)
def test_invalid_config_names_the_problem(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfig, match=message.replace("[", r"\[").replace("(", r"\(")):
        codec_and_chunks(**kwargs)


def test_config_is_frozen() -> None:
    config = CodecParams()
    with pytest.raises(AttributeError):
        config.scheme = "int4"  # type: ignore[misc]


def test_negative_zstd_levels_are_allowed() -> None:
    assert CodecParams(zstd_level=-5).zstd_level == -5


def test_tensor_spec_numel_and_dtype() -> None:
    assert TensorLayout("w", "bfloat16", (3, 0, 2)).numel == 0
    assert TensorLayout("s", "float32", ()).numel == 1
    assert TensorLayout("m", "float16", (4, 5)).numel == 20


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", "float32", (1,)), "must be a non-empty string"),
        (("w", "int8", (1,)), "dtype 'int8' is not one of"),
        (("w", "float32", [1]), "shape must be a tuple"),
        (("w", "float32", (-1,)), "has a size that is not an int >= 0"),
        (("w", "float32", (2.0,)), "has a size that is not an int >= 0"),
        (("w", "float32", (1 << 40, 1 << 40)), "more than"),
        (("\ud800", "float32", (1,)), "not valid Unicode"),
        (("x" * 1025, "float32", (1,)), "longer than 1024 bytes"),
    ],
)
def test_invalid_tensor_spec(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        TensorLayout(*args)
