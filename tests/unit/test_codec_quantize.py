"""Blockwise quantization math: scales, codes, error bounds, stochastic rounding."""

from __future__ import annotations

import math

import pytest
import torch

from geofed.codec import CorruptChunk, EncodeError, NonFiniteValue, quantize
from geofed.codec.layout import payload_size
from geofed.codec.quantize import MAX_SCALE, MIN_SCALE, QMAX, BlockCodec
from geofed.codec_params import Scheme

# Decoding computes q * s exactly; the only float error is in x * fl(1/s) before rounding:
# |q - x/s| <= 1/2 + qmax * (2u + u^2) / (1 - u) with u = 2**-24, below 1/2 + 2**-16 for
# qmax <= 127.
SLACK = 2.0**-16


def scales_of(codec: BlockCodec, payload: torch.Tensor, count: int) -> torch.Tensor:
    nblocks = -(-count // codec.block_size)
    return payload[: 2 * nblocks].view(torch.bfloat16).to(torch.float64)


def per_element(scales: torch.Tensor, block: int, count: int) -> torch.Tensor:
    return scales.repeat_interleave(block)[:count]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("count", [1, 127, 128, 129, 1000, 4096 + 3])
@pytest.mark.parametrize("tile", [256, 1 << 20])
def test_error_is_at_most_half_a_step_of_its_block(scheme: Scheme, count: int, tile: int) -> None:
    generator = torch.Generator().manual_seed(count)
    x = torch.randn(count, generator=generator) * torch.logspace(-8, 3, count).flip(0)
    codec = BlockCodec(scheme, 128, tile_elements=tile)
    payload = codec.encode(x, label="x").clone()
    assert payload.numel() == payload_size(scheme, count, 128)
    decoded = codec.decode(payload, count, label="x")
    step = per_element(scales_of(codec, payload, count), 128, count)
    error = (decoded.double() - x.double()).abs()
    assert bool((error <= step * (0.5 + SLACK)).all())


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_scales_are_bfloat16_rounded_up_from_absmax(scheme: Scheme) -> None:
    x = torch.tensor([0.3, -1.7, 0.0, 1.0] * 32 + [5e-3] * 128 + [0.0] * 128)
    codec = BlockCodec(scheme, 128)
    payload = codec.encode(x, label="x")
    scales = scales_of(codec, payload, x.numel())
    qmax = QMAX[scheme]
    exact = torch.tensor([1.7 / qmax, 5e-3 / qmax], dtype=torch.float64)
    assert bool((scales[:2] >= exact * (1 - 2**-24)).all())
    assert bool((scales[:2] <= exact * (1 + 2**-7)).all())
    assert scales[2].item() == MIN_SCALE  # an all-zero block
    # The largest element lands on +-qmax (or qmax - 1 when rounding up the scale costs it).
    decoded = codec.decode(payload, x.numel(), label="x")
    assert abs(decoded[1].item() / scales[0].item()) in (qmax, qmax - 1)


def test_decoded_values_are_exact_products_of_code_and_scale() -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    codec = BlockCodec("int8", 64)
    payload = codec.encode(x, label="x").clone()
    codes = payload[2 * 64 :].view(torch.int8).to(torch.float64)
    expected = codes * per_element(scales_of(codec, payload, 4096), 64, 4096)
    assert torch.equal(codec.decode(payload, 4096, label="x").double(), expected)


def test_int4_packs_two_codes_per_byte_low_nibble_first() -> None:
    codec = BlockCodec("int4", 4)
    x = torch.tensor([7.0, -7.0, 1.0, 0.0, 3.5])  # scales 1 and 0.5, both exact
    payload = codec.encode(x, label="x")
    assert payload.numel() == 2 * 2 + 3
    assert payload[4:].tolist() == [
        (7 + 8) | ((-7 + 8) << 4),
        (1 + 8) | (8 << 4),
        (7 + 8) | (8 << 4),
    ]
    assert codec.decode(payload.clone(), 5, label="x").tolist() == x.tolist()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_input_is_quantized_from_its_exact_value(dtype: torch.dtype) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2)).to(dtype)
    codec = BlockCodec("int8", 128)
    from_half = codec.encode(x, label="x").clone()
    from_float = codec.encode(x.float(), label="x").clone()
    assert torch.equal(from_half, from_float)


def test_tiny_and_subnormal_values_stay_within_the_bound() -> None:
    x = torch.tensor([1e-45, -3e-40, 1e-38, 0.0] * 32)
    codec = BlockCodec("int8", 128)
    payload = codec.encode(x, label="x").clone()
    decoded = codec.decode(payload, 128, label="x")
    step = scales_of(codec, payload, 128)[0].item()
    assert step >= MIN_SCALE
    assert (decoded.double() - x.double()).abs().max().item() <= step * (0.5 + SLACK)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_stochastic_rounding_is_unbiased_and_within_one_step(scheme: Scheme) -> None:
    codec = BlockCodec(scheme, 128, stochastic_rounding=True)
    x = torch.linspace(-1, 1, 128, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    trials = torch.stack(
        [
            codec.decode(codec.encode(x, label="x", generator=generator).clone(), 128, label="x")
            for _ in range(400)
        ]
    ).double()
    step = 1.0 / QMAX[scheme] * (1 + 2**-7)
    assert (trials - x.double()).abs().max().item() < step * (1 + SLACK)
    # Each code is x/s rounded down or up at random: the mean converges to x.
    # Per element the standard error is at most step / (2 * sqrt(400)) = step / 40.
    bias = (trials.mean(dim=0) - x.double()).abs()
    assert bias.max().item() < 5 * step / 40
    nearest = BlockCodec(scheme, 128).decode(
        BlockCodec(scheme, 128).encode(x, label="x").clone(), 128, label="x"
    )
    assert not torch.equal(trials[0].float(), nearest)


def test_stochastic_rounding_is_reproducible_from_the_generator_seed() -> None:
    codec = BlockCodec("int4", 32, stochastic_rounding=True)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    first = codec.encode(x, label="x", generator=torch.Generator().manual_seed(9)).clone()
    second = codec.encode(x, label="x", generator=torch.Generator().manual_seed(9)).clone()
    other = codec.encode(x, label="x", generator=torch.Generator().manual_seed(10)).clone()
    assert torch.equal(first, second)
    assert not torch.equal(first, other)


@pytest.mark.parametrize("scheme", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_names_the_first_bad_element(scheme: Scheme, bad: float) -> None:
    x = torch.zeros(300)
    x[201] = bad
    x[250] = bad
    with pytest.raises(NonFiniteValue, match=f"delta w: element 201 is {bad}"):
        BlockCodec(scheme, 128).encode(x, label="delta w")


def test_values_too_large_for_a_bfloat16_scale_are_refused() -> None:
    x = torch.tensor([1.0, 3e38, 2.0])
    with pytest.raises(EncodeError, match=r"element 1 = 3.000e\+38 is too large"):
        BlockCodec("int4", 128).encode(x, label="x")
    # int8 reaches further: 127 * 2**120 is about 1.7e38.
    assert BlockCodec("int8", 128).encode(torch.tensor([1e38]), label="x").numel() == 3


@pytest.mark.parametrize("scale", [math.nan, math.inf, -1.0, 0.0, 1e-38, MAX_SCALE * 2])
def test_decoder_refuses_payloads_with_impossible_scales(scale: float) -> None:
    codec = BlockCodec("int8", 128)
    payload = codec.encode(torch.ones(256), label="x").clone()
    payload[2:4].view(torch.bfloat16)[0] = scale
    with pytest.raises(CorruptChunk, match="chunk 7: block scales must lie in"):
        codec.decode(payload, 256, label="chunk 7")


def test_decoder_refuses_fp32_payloads_with_nan() -> None:
    payload = torch.tensor([1.0, math.nan]).view(torch.uint8).clone()
    with pytest.raises(CorruptChunk, match="chunk 2: payload holds NaN or Inf"):
        BlockCodec("fp32", 128).decode(payload, 2, label="chunk 2")


def test_decode_into_a_given_buffer() -> None:
    codec = BlockCodec("int8", 128)
    payload = codec.encode(torch.arange(300, dtype=torch.float32), label="x").clone()
    out = torch.full((300,), -1.0)
    assert codec.decode(payload, 300, label="x", out=out) is out
    assert (out - torch.arange(300)).abs().max().item() < 1.2


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("block", [2, 16, 128])
@pytest.mark.parametrize("magnitude", [1.0, 1e-30, 1e30])
def test_small_slices_take_the_numpy_path_to_the_same_bytes_and_values(
    scheme: Scheme, block: int, magnitude: float
) -> None:
    generator = torch.Generator().manual_seed(block)
    for count in [1, 3, block - 1, block, block + 1, 3 * block + 7, 1000, quantize.SMALL_ELEMENTS]:
        values = torch.randn(count, generator=generator) ** 3 * magnitude
        values[count // 2] = -0.0
        small = BlockCodec(scheme, block).encode(values, label="x", reuse_buffer=False)
        decoded = BlockCodec(scheme, block).decode(small, count, label="x")
        torch_only = BlockCodec(scheme, block, small_elements=0)
        large = torch_only.encode(values, label="x", reuse_buffer=False)
        reference = torch_only.decode(small, count, label="x")
        assert torch.equal(small, large), count
        assert torch.equal(decoded.view(torch.int32), reference.view(torch.int32)), count


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 3e38])
def test_small_slices_refuse_bad_values_and_scales_like_large_ones(bad: float) -> None:
    values = torch.randn(300)
    values[7] = bad
    with pytest.raises(EncodeError, match="element 7"):
        BlockCodec("int4", 128).encode(values, label="x")
    payload = BlockCodec("int8", 128).encode(torch.randn(300), label="x", reuse_buffer=False)
    payload[2:4] = torch.tensor([bad], dtype=torch.bfloat16).view(torch.uint8)
    with pytest.raises(CorruptChunk, match=r"x: block scales must lie in \[2\*\*-120, 2\*\*120\]"):
        BlockCodec("int8", 128).decode(payload, 300, label="x")


@pytest.mark.parametrize(
    ("scheme", "stochastic"),
    [("fp32", False), ("int8", False), ("int8", True), ("int4", False), ("int4", True)],
)
@pytest.mark.parametrize("count", [1, 127, 129, 1000, quantize.SMALL_ELEMENTS + 3, 20000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_out_is_the_slice_minus_its_decoded_values_bit_for_bit(
    scheme: Scheme, stochastic: bool, count: int, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(count)
    x = (torch.randn(count, generator=generator) ** 3).to(dtype)
    x[::3] = -0.0  # rounds to a code of -0, which decodes to +0
    codec = BlockCodec(scheme, 128, stochastic_rounding=stochastic, tile_elements=4096)
    residual = torch.full((count,), math.nan)
    payload = codec.encode(x, label="x", generator=generator, residual_out=residual).clone()
    expected = x.float() - codec.decode(payload, count, label="x")
    assert torch.equal(residual.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_small_slices_write_the_same_residual_as_large_ones(scheme: Scheme) -> None:
    values = torch.randn(1000, generator=torch.Generator().manual_seed(5)) ** 3
    values[::4] = -0.0
    small = torch.empty(1000)
    BlockCodec(scheme, 64).encode(values, label="x", residual_out=small)
    large = torch.empty(1000)
    BlockCodec(scheme, 64, small_elements=0).encode(values, label="x", residual_out=large)
    assert torch.equal(small.view(torch.int32), large.view(torch.int32))
