"""Quantizing apart from sealing: the same bytes, residuals and values as encoding whole."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from geofed.codec import (
    EncodeError,
    InvalidQuantized,
    NonFiniteValue,
    QuantizedTensors,
    decode,
    dequantize,
    encode_stream,
    quantize_tensors,
    seal_quantized,
    write_quantized,
)
from geofed.codec.compression import CompressionPolicy
from geofed.codec.quantize import SMALL_ELEMENTS
from geofed.codec_params import CodecParams

# Every device here runs the device cases; the CPU always does.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

CODECS = [
    CodecParams(scheme="fp32"),
    CodecParams(scheme="int8"),
    CodecParams(scheme="int8", stochastic_rounding=True),
    CodecParams(scheme="int4", block_size=64),
    CodecParams(scheme="int4", block_size=64, stochastic_rounding=True),
]
CHUNK = 4096


def tensors(device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Chunked tensors with tails, tiny ones (numpy path), an empty one, half precisions."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) ** 3 * 1e-3

    out = {
        "layer.weight": randn(97, 101),  # 9797: three chunks, the last with a partial block
        "layer.bias": randn(101),
        "tiny": randn(3),
        "empty": torch.empty(0, 5),
        "half": randn(SMALL_ELEMENTS + 7).half(),
        "brain": randn(130).bfloat16(),
    }
    out["layer.bias"][::7] = -0.0
    return {name: tensor.to(device) for name, tensor in out.items()}


def generator_for(device: str, seed: int = 7) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that -0.0 and 0.0 (or two NaNs) are told apart."""
    return tensor.contiguous().view(torch.int32 if tensor.element_size() == 4 else torch.int16)


def assert_same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].device == tensor.device, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(bits(got[name]), bits(tensor)), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", CODECS, ids=str)
@pytest.mark.parametrize("compression", ["auto", "zstd", "none"])
@pytest.mark.parametrize("workers", [1, 2])
def test_sealing_quantized_tensors_gives_the_bytes_of_encode_stream(
    device: str, codec: CodecParams, compression: CompressionPolicy, workers: int
) -> None:
    delta = tensors(device)
    quantized, _ = quantize_tensors(
        delta, codec, chunk_elements=CHUNK, generator=generator_for(device)
    )
    sealed = seal_quantized(quantized, workers=workers, compression=compression)
    whole = encode_stream(
        delta,
        codec,
        chunk_elements=CHUNK,
        generator=generator_for(device),
        workers=workers,
        compression=compression,
    )
    assert sealed.to_bytes() == whole.to_bytes()
    assert sealed.digests == whole.digests
    assert quantized.fp32_bytes == whole.fp32_bytes
    # Written out frame by frame: the same bytes, and each frame's size in order.
    written: list[bytes] = []
    sizes = write_quantized(quantized, written.append, workers=workers, compression=compression)
    assert b"".join(written) == whole.to_bytes()
    assert sizes == [len(frame) for frame in whole.frames()]
    assert all(p.device.type == "cpu" and p.dtype == torch.uint8 for p in quantized.payloads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", CODECS, ids=str)
def test_dequantize_gives_the_bits_of_decoding_the_sealed_stream(
    device: str, codec: CodecParams
) -> None:
    quantized, _ = quantize_tensors(
        tensors(device), codec, chunk_elements=CHUNK, generator=generator_for(device)
    )
    assert_same_bits(dequantize(quantized), decode(seal_quantized(quantized).frames()))


def old_error_feedback(
    delta: dict[str, torch.Tensor],
    residual: dict[str, torch.Tensor] | None,
    codec: CodecParams,
    generator: torch.Generator,
) -> tuple[bytes, dict[str, torch.Tensor]]:
    """Error feedback as it used to run: compensate, encode, decode on the host, subtract."""
    compensated: dict[str, torch.Tensor] = {}
    for name, tensor in delta.items():
        compensated[name] = tensor.to(torch.float32, copy=True)
        if residual is not None:
            compensated[name].add_(residual[name].to(tensor.device))
    stream = encode_stream(compensated, codec, chunk_elements=CHUNK, generator=generator)
    decoded = decode(stream.frames())
    new = {name: c - decoded[name].to(c.device) for name, c in compensated.items()}
    return stream.to_bytes(), new


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", CODECS, ids=str)
def test_the_new_residual_is_bit_for_bit_that_of_decoding_on_the_host(
    device: str, codec: CodecParams
) -> None:
    delta = {name: t.float() for name, t in tensors(device).items()}
    first, residual = quantize_tensors(
        delta, codec, chunk_elements=CHUNK, generator=generator_for(device)
    )
    want_bytes, want = old_error_feedback(delta, None, codec, generator_for(device))
    assert seal_quantized(first).to_bytes() == want_bytes
    assert_same_bits(residual, want)
    # A second round compensates: -0.0 + -0.0 stays -0.0 and rounds to a code of -0.
    later = tensors(device, seed=1)
    for name in later:
        later[name].view(-1)[::5] = -0.0
        residual[name].view(-1)[::5] = -0.0
    second, new = quantize_tensors(
        later, codec, chunk_elements=CHUNK, generator=generator_for(device, 8), residual=residual
    )
    want_bytes, want = old_error_feedback(later, residual, codec, generator_for(device, 8))
    assert seal_quantized(second).to_bytes() == want_bytes
    assert_same_bits(new, want)
    # Compensated tensors are float32, and so recorded.
    assert {spec.dtype for spec in second.specs} == {"float32"}


@pytest.mark.parametrize("device", DEVICES)
def test_the_residual_stays_on_the_device_in_float32(device: str) -> None:
    delta = tensors(device)
    _, residual = quantize_tensors(delta, CodecParams(), chunk_elements=CHUNK)
    for name, tensor in delta.items():
        assert residual[name].device == tensor.device
        assert residual[name].dtype == torch.float32
        assert residual[name].shape == tensor.shape


def test_payloads_are_kept_apart_from_the_input_and_from_each_other() -> None:
    delta = tensors("cpu")
    for codec in (CodecParams(scheme="fp32"), CodecParams(scheme="int8")):
        quantized, _ = quantize_tensors(delta, codec, chunk_elements=CHUNK)
        before = seal_quantized(quantized).to_bytes()
        for tensor in delta.values():
            tensor.add_(1.0)
        assert seal_quantized(quantized).to_bytes() == before
        pointers = {payload.untyped_storage().data_ptr() for payload in quantized.payloads}
        assert len(pointers) == len(quantized.payloads)


def saved_and_loaded(state: dict[str, Any]) -> object:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("codec", CODECS, ids=str)
def test_state_round_trips_through_torch_save_and_a_weights_only_load(
    codec: CodecParams,
) -> None:
    quantized, _ = quantize_tensors(tensors("cpu"), codec, chunk_elements=CHUNK)
    restored = QuantizedTensors.from_state(saved_and_loaded(quantized.to_state()))
    assert restored.specs == quantized.specs
    assert restored.codec == quantized.codec
    assert restored.chunk_elements == quantized.chunk_elements
    assert seal_quantized(restored).to_bytes() == seal_quantized(quantized).to_bytes()
    assert_same_bits(dequantize(restored), dequantize(quantized))


def test_an_empty_state_round_trips() -> None:
    quantized, residual = quantize_tensors({}, CodecParams())
    assert residual == {}
    restored = QuantizedTensors.from_state(saved_and_loaded(quantized.to_state()))
    assert seal_quantized(restored).to_bytes() == encode_stream({}, CodecParams()).to_bytes()


def _set(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        state[key] = value

    return change


def _drop_last_payload(state: dict[str, Any]) -> None:
    last = state["payload_sizes"].pop()
    state["payloads"] = state["payloads"][:-last]


def _shift_a_byte(state: dict[str, Any]) -> None:
    state["payload_sizes"][0] -= 1
    state["payload_sizes"][1] += 1


def _nan_scale(state: dict[str, Any]) -> None:
    state["payloads"][0:2] = torch.tensor([math.nan], dtype=torch.bfloat16).view(torch.uint8)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.pop("codec"), r"missing \['codec'\]"),
        (_set("extra", 1), r"unknown \['extra'\]"),
        (_set("version", 2), "version 2 is not 1"),
        (_set("codec", {"scheme": "int7"}), "codec: scheme 'int7' is not one of"),
        (_set("codec", {"scheme": "int8", "level": 3}), "codec must be a dict with keys"),
        (_set("chunk_elements", 4000), "chunk_elements 4000 is not a multiple of block_size"),
        (_set("chunk_elements", True), "chunk_elements must be an int, not bool"),
        (_set("tensors", [["", "float32", [3]]]), "tensors\\[0\\]: tensor name '' must be"),
        (_set("tensors", [["w", "int8", [3]]]), "dtype 'int8' is not one of"),
        (_set("tensors", [["w", "float32", [-1]]]), "has a size that is not an int >= 0"),
        (_set("tensors", [["w", "float32"]]), r"tensors\[0\] must be \[name, dtype, shape\]"),
        (
            _set("tensors", [["w", "float32", [1]], ["w", "float32", [1]]]),
            "name 'w' repeats",
        ),
        (_drop_last_payload, "payloads: 8 given, the layout has 9 chunks"),
        (_shift_a_byte, r"payload 0 holds 4159 bytes; chunk 0 \(tensor 'layer.weight'"),
        (_set("payloads", torch.zeros(3)), "payloads must be a 1-D uint8 tensor"),
        (_set("payload_sizes", [1.5]), "payload_sizes must be a list of ints"),
        (_set("payload_sizes", [1, 2]), "payloads holds .* bytes, payload_sizes add up to 3"),
        (_nan_scale, r"payload 0: block scales must lie in .*NaN or Inf"),
    ],
)
def test_invalid_states_are_refused_naming_the_field(
    change: Callable[[dict[str, Any]], None], message: str
) -> None:
    quantized, _ = quantize_tensors(tensors("cpu"), CodecParams(), chunk_elements=CHUNK)
    state = quantized.to_state()
    change(state)
    with pytest.raises(InvalidQuantized, match=f"^upload 3: .*{message}"):
        QuantizedTensors.from_state(state, "upload 3")


def test_a_state_that_is_not_a_dict_is_refused() -> None:
    with pytest.raises(InvalidQuantized, match="quantized delta: state must be a dict, not list"):
        QuantizedTensors.from_state([])


def test_an_fp32_payload_holding_nan_is_refused() -> None:
    quantized, _ = quantize_tensors({"w": torch.ones(3)}, CodecParams(scheme="fp32"))
    state = quantized.to_state()
    state["payloads"].view(torch.float32)[1] = math.nan
    with pytest.raises(InvalidQuantized, match="payload 0 holds NaN or Inf"):
        QuantizedTensors.from_state(state)


def test_sealing_and_dequantizing_refuse_payloads_off_the_layout() -> None:
    quantized, _ = quantize_tensors(tensors("cpu"), CodecParams(), chunk_elements=CHUNK)
    short = QuantizedTensors(
        quantized.specs, quantized.codec, quantized.chunk_elements, quantized.payloads[:-1]
    )
    with pytest.raises(InvalidQuantized, match="payloads: 8 given, the layout has 9 chunks"):
        seal_quantized(short)
    wrong = list(quantized.payloads)
    wrong[2] = wrong[2].view(torch.int8)
    with pytest.raises(InvalidQuantized, match="payload 2 must be a contiguous 1-D uint8"):
        dequantize(QuantizedTensors(quantized.specs, quantized.codec, CHUNK, wrong))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", CODECS, ids=str)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_values_are_refused_and_the_generator_restored(
    device: str, codec: CodecParams, bad: float
) -> None:
    delta = tensors(device)
    delta["layer.bias"][42] = bad
    generator = generator_for(device)
    state = generator.get_state()
    with pytest.raises(NonFiniteValue, match=r"tensor 'layer.bias' elements \[0:101\]: element 42"):
        quantize_tensors(delta, codec, chunk_elements=CHUNK, generator=generator)
    assert torch.equal(generator.get_state(), state)
    # A residual can make a finite delta non-finite; that is refused alike.
    clean = tensors(device)
    residual = {name: torch.zeros_like(t, dtype=torch.float32) for name, t in clean.items()}
    residual["tiny"][1] = bad
    with pytest.raises(NonFiniteValue, match=r"tensor 'tiny' elements \[0:3\]: element 1"):
        quantize_tensors(clean, codec, generator=generator, residual=residual)
    assert torch.equal(generator.get_state(), state)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.pop("tiny"), r"missing \['tiny'\], extra \[\]"),
        (_set("other", torch.zeros(2)), r"missing \[\], extra \['other'\]"),
        (_set("tiny", torch.zeros(4)), r"residual 'tiny' has shape \(4,\), the tensor \(3,\)"),
        (_set("tiny", [0.0, 0.0, 0.0]), "residual 'tiny' is not a floating-point tensor"),
        (_set("tiny", torch.zeros(3, dtype=torch.int32)), "is not a floating-point tensor"),
    ],
)
def test_a_residual_that_does_not_fit_the_tensors_is_refused(
    change: Callable[[dict[str, Any]], None], message: str
) -> None:
    delta = tensors("cpu")
    residual: dict[str, Any] = {name: torch.zeros(t.shape) for name, t in delta.items()}
    change(residual)
    generator = generator_for("cpu")
    state = generator.get_state()
    with pytest.raises(EncodeError, match=message):
        quantize_tensors(delta, CodecParams(), generator=generator, residual=residual)
    assert torch.equal(generator.get_state(), state)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(EncodeError, match="codec must be a CodecParams"):
        quantize_tensors({}, "int8")  # type: ignore[arg-type]
    with pytest.raises(EncodeError, match=r"dtype torch\.float64"):
        quantize_tensors({"w": torch.ones(2, dtype=torch.float64)}, CodecParams())
    quantized, _ = quantize_tensors({"w": torch.ones(2)}, CodecParams())
    with pytest.raises(EncodeError, match="workers 0 must be"):
        seal_quantized(quantized, workers=0)
    with pytest.raises(EncodeError, match="compression 'lz4' is not one of"):
        seal_quantized(quantized, compression="lz4")  # type: ignore[arg-type]
    with pytest.raises(InvalidQuantized, match="expected QuantizedTensors, not dict"):
        seal_quantized({})  # type: ignore[arg-type]
