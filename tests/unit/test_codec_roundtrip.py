"""Encode/decode round trips through the public API, with property tests."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geofed.codec import (
    EncodeError,
    NonFiniteValue,
    decode,
    decode_pieces,
    encode,
    encode_stream,
)
from geofed.codec_params import CodecParams, Scheme

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
QMAX = {"int8": 127, "int4": 7}
# Scale: absmax/qmax rounded up onto bfloat16 (at most 2**-7 relative), at least 2**-120.
# Error: half a step plus 2**-16 of a step from computing x * fl(1/s) in float32.
SCALE_ROUNDING = 1 + 2**-7 + 2**-20
SLACK = 2.0**-16
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensor_maps(draw: st.DrawFn, dtypes: list[torch.dtype] = DTYPES) -> dict[str, torch.Tensor]:
    """Small named tensors: any rank up to 3, empty ones, mixed magnitudes and zeros."""
    count = draw(st.integers(0, 4))
    names = draw(
        st.lists(st.text(min_size=1, max_size=12), min_size=count, max_size=count, unique=True)
    )
    tensors = {}
    for name in names:
        shape = tuple(draw(st.lists(st.integers(0, 23), max_size=3)))
        dtype = draw(st.sampled_from(dtypes))
        seed = draw(st.integers(0, 2**31))
        exponent = draw(st.integers(-20, 4 if dtype is torch.float16 else 20))
        generator = torch.Generator().manual_seed(seed)
        values = torch.randn(shape, generator=generator) * 10.0**exponent
        if draw(st.booleans()):
            values = values * (torch.rand(shape, generator=generator) < 0.5)
        tensors[name] = values.to(dtype)
    return tensors


@PROPERTY
@given(tensor_maps())
def test_fp32_round_trips_bit_exactly(tensors: dict[str, torch.Tensor]) -> None:
    decoded = decode(encode(tensors, scheme="fp32"))
    assert list(decoded) == list(tensors)
    for name, tensor in tensors.items():
        assert decoded[name].dtype == tensor.dtype
        assert decoded[name].shape == tensor.shape
        assert torch.equal(
            decoded[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)
        )


@PROPERTY
@given(tensor_maps(), st.sampled_from(["int8", "int4"]), st.sampled_from([2, 16, 128]))
def test_quantized_error_is_within_half_a_step_of_its_block(
    tensors: dict[str, torch.Tensor], scheme: Scheme, block_size: int
) -> None:
    config = CodecParams(scheme=scheme, block_size=block_size)
    stream = encode_stream(tensors, config, chunk_elements=block_size * 3)
    assert [spec.name for spec in stream.specs] == list(tensors)
    for piece in decode_pieces(stream.to_bytes()):
        assert piece.values.dtype == torch.float32
        assert piece.values.shape == (piece.count,)
        x = tensors[piece.name].reshape(-1)[piece.offset : piece.offset + piece.count].double()
        padded = torch.nn.functional.pad(x, (0, -x.numel() % block_size))
        absmax = padded.view(-1, block_size).abs().amax(dim=1)
        step = (absmax / QMAX[scheme] * SCALE_ROUNDING).clamp(min=2.0**-120)
        bound = step.repeat_interleave(block_size)[: x.numel()] * (0.5 + SLACK)
        assert bool(((piece.values.double() - x).abs() <= bound).all())
    decoded = decode(stream.to_bytes())
    for name, tensor in tensors.items():
        assert decoded[name].dtype == tensor.dtype
        assert decoded[name].shape == tensor.shape


@PROPERTY
@given(tensor_maps(), st.sampled_from(["fp32", "int8", "int4"]))
def test_decoding_is_deterministic_and_matches_the_pieces(
    tensors: dict[str, torch.Tensor], scheme: Scheme
) -> None:
    data = encode(tensors, scheme=scheme)
    assert encode(tensors, scheme=scheme) == data
    first, second = decode(data), decode(bytearray(data))
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name])
    for piece in decode_pieces(data):
        flat = first[piece.name].reshape(-1)[piece.offset : piece.offset + piece.count]
        assert torch.equal(flat, piece.values.to(flat.dtype))


@pytest.mark.parametrize("scheme", ["fp32", "int8", "int4"])
def test_non_contiguous_and_odd_shapes_keep_their_layout(scheme: Scheme) -> None:
    base = torch.randn(40, 30, generator=torch.Generator().manual_seed(5))
    tensors = {
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "expanded": torch.randn(1, 7).expand(5, 7),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(3, 0, 4),
        "bf16": base.bfloat16()[:, :5],
    }
    decoded = decode(encode(tensors, scheme=scheme, block_size=8))
    tolerance = 0.0 if scheme == "fp32" else 0.6
    for name, tensor in tensors.items():
        assert decoded[name].shape == tensor.shape
        assert decoded[name].dtype == tensor.dtype
        assert decoded[name].is_contiguous()
        if tensor.numel():
            error = (decoded[name].float() - tensor.float()).abs().max().item()
            assert error <= tolerance * tensor.abs().max().item()


def test_tensors_spanning_many_chunks_decode_in_order() -> None:
    tensors = {"a": torch.randn(1000), "b": torch.randn(10), "c": torch.randn(33, 7)}
    config = CodecParams(scheme="int8", block_size=16)
    stream = encode_stream(tensors, config, chunk_elements=96)
    expected = [(name, offset) for name, t in tensors.items() for offset in range(0, t.numel(), 96)]
    assert [(chunk.tensor, chunk.offset) for chunk in stream.chunks] == expected
    assert [chunk.index for chunk in stream.chunks] == list(range(len(expected)))
    pieces = list(decode_pieces(stream.to_bytes()))
    assert [(p.name, p.offset, p.count) for p in pieces] == [
        (c.tensor, c.offset, c.count) for c in stream.chunks
    ]


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_returns_the_original_dtype_within_its_rounding(dtype: torch.dtype) -> None:
    x = (torch.randn(5000, generator=torch.Generator().manual_seed(6)) * 3).to(dtype)
    stream = encode_stream({"x": x}, CodecParams(scheme="int8"))
    (piece,) = decode_pieces(stream.to_bytes())
    decoded = decode(stream.to_bytes())["x"]
    assert torch.equal(decoded, piece.values.to(dtype))


def test_compression_ratios_on_gaussian_deltas() -> None:
    x = {"w": torch.randn(1 << 16, generator=torch.Generator().manual_seed(7)) * 1e-3}
    fp32_bytes = 4 * (1 << 16)
    int8 = encode_stream(x, CodecParams(scheme="int8"))
    int4 = encode_stream(x, CodecParams(scheme="int4"))
    assert int8.fp32_bytes == fp32_bytes
    # Before zstd: 4 * 128 / (128 + 2) = 3.94 and 4 * 128 / (64 + 2) = 7.76.
    assert 3.9 < fp32_bytes / int8.total_bytes < 4.6
    assert 7.6 < fp32_bytes / int4.total_bytes < 10.0


def test_stochastic_rounding_through_the_stream_is_seeded() -> None:
    x = {"w": torch.randn(3000, generator=torch.Generator().manual_seed(8))}
    config = CodecParams(scheme="int4", stochastic_rounding=True)
    first = encode_stream(x, config, generator=torch.Generator().manual_seed(1)).to_bytes()
    again = encode_stream(x, config, generator=torch.Generator().manual_seed(1)).to_bytes()
    other = encode_stream(x, config, generator=torch.Generator().manual_seed(2)).to_bytes()
    assert first == again
    assert first != other


def test_failed_encode_restores_the_generator() -> None:
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    tensors = {"ok": torch.randn(3000), "bad": torch.tensor([1.0, math.nan])}
    config = CodecParams(scheme="int8", stochastic_rounding=True)
    with pytest.raises(NonFiniteValue, match="tensor 'bad' elements \\[0:2\\]: element 1 is nan"):
        encode_stream(tensors, config, generator=generator)
    assert torch.equal(generator.get_state(), state)


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"w": torch.zeros(3, dtype=torch.int64)}, "tensor 'w' has dtype torch.int64"),
        ({"w": torch.zeros(3, dtype=torch.float64)}, "tensor 'w' has dtype torch.float64"),
        ({"w": [1.0, 2.0]}, "tensor 'w' is a list, not a torch.Tensor"),
        ({"": torch.zeros(3)}, "tensor name '' must be a non-empty string"),
        ({3: torch.zeros(3)}, "tensor name 3 must be a non-empty string"),
        ({"w": torch.tensor([0.0, math.inf])}, "tensor 'w' elements \\[0:2\\]: element 1 is inf"),
        ({"w": torch.zeros(3).to_sparse()}, "tensor 'w' is torch.sparse_coo on cpu; only dense"),
        ({"w": torch.zeros(3, device="meta")}, "tensor 'w' is torch.strided on meta; only dense"),
    ],
)
def test_encode_refuses_bad_input_naming_the_tensor(tensors: object, message: str) -> None:
    with pytest.raises(EncodeError, match=message):
        encode(tensors)  # type: ignore[arg-type]


def test_encode_refuses_a_non_mapping() -> None:
    with pytest.raises(EncodeError, match="must be a mapping of name to tensor, not list"):
        encode([torch.zeros(3)])  # type: ignore[arg-type]


def test_gradients_are_not_required_to_be_detached() -> None:
    weight = torch.randn(10, requires_grad=True)
    decoded = decode(encode({"w": weight * 2}, scheme="fp32"))
    assert torch.equal(decoded["w"], (weight * 2).detach())


def test_an_empty_mapping_round_trips() -> None:
    stream = encode_stream({}, CodecParams())
    assert stream.chunks == []
    assert decode(stream.to_bytes()) == {}


@pytest.mark.parametrize("scheme", ["fp32", "int8", "int4"])
def test_workers_produce_the_same_bytes(scheme: Scheme) -> None:
    generator = torch.Generator().manual_seed(11)
    tensors = {f"t{i}": torch.randn(700, generator=generator) for i in range(6)}
    config = CodecParams(scheme=scheme, block_size=32)
    inline = encode_stream(tensors, config, chunk_elements=128)
    threaded = encode_stream(tensors, config, chunk_elements=128, workers=3)
    assert threaded.to_bytes() == inline.to_bytes()
    assert threaded.digests == inline.digests


def test_workers_surface_encode_errors_and_validate() -> None:
    tensors = {"a": torch.randn(1000), "b": torch.tensor([1.0, -math.inf])}
    with pytest.raises(NonFiniteValue, match="tensor 'b'"):
        encode_stream(tensors, CodecParams(), chunk_elements=128, workers=2)
    with pytest.raises(EncodeError, match="workers 0 must be an int from 1"):
        encode_stream(tensors, CodecParams(), workers=0)
