"""Error feedback: the residual carries quantization error into the next round."""

from __future__ import annotations

import io
import math

import pytest
import torch

from geofed.codec import ErrorFeedback, ErrorFeedbackError, decode, encode_stream
from geofed.codec_params import CodecParams, Scheme


def deltas(rounds: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            "w": torch.randn(64, 32, generator=generator) * 1e-3,
            "b": torch.randn(32, generator=generator).bfloat16() * 1e-3,
        }
        for _ in range(rounds)
    ]


def test_first_compensation_is_the_delta_in_float32() -> None:
    feedback = ErrorFeedback()
    (delta,) = deltas(1)
    compensated = feedback.compensate(delta)
    assert compensated["b"].dtype == torch.float32
    assert torch.equal(compensated["b"], delta["b"].float())
    assert compensated["w"] is not delta["w"]


def test_update_keeps_compensated_minus_reconstructed() -> None:
    feedback = ErrorFeedback()
    compensated = {"w": torch.tensor([1.0, 2.0, 3.0])}
    feedback.update(compensated, {"w": torch.tensor([0.5, 2.0, 3.5])})
    assert feedback.residual["w"].tolist() == [0.5, 0.0, -0.5]
    assert feedback.compensate({"w": torch.ones(3)})["w"].tolist() == [1.5, 1.0, 0.5]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_feedback_keeps_the_sum_of_transmitted_updates_close_to_the_true_sum(
    scheme: Scheme,
) -> None:
    config = CodecParams(scheme=scheme, block_size=64)
    feedback = ErrorFeedback()
    true_sum = torch.zeros(64, 32, dtype=torch.float64)
    with_feedback = torch.zeros_like(true_sum)
    without_feedback = torch.zeros_like(true_sum)
    for delta in deltas(30):
        true_sum += delta["w"].double()
        stream = feedback.step(delta, config)
        with_feedback += decode(stream.to_bytes())["w"].double()
        without_feedback += decode(encode_stream(delta, config).to_bytes())["w"].double()
    # With feedback the transmitted sum misses only the last residual (one round's error);
    # without it the rounding errors of every round add up.
    gap_with = (with_feedback - true_sum).abs().max().item()
    gap_without = (without_feedback - true_sum).abs().max().item()
    residual = feedback.residual["w"].double()
    assert torch.allclose(with_feedback + residual, true_sum, atol=1e-9)
    assert gap_with < gap_without / 2


def test_state_dict_round_trips_through_torch_save() -> None:
    feedback = ErrorFeedback()
    feedback.step(deltas(1)[0], CodecParams(scheme="int4"))
    buffer = io.BytesIO()
    torch.save(feedback.state_dict(), buffer)
    buffer.seek(0)
    restored = ErrorFeedback()
    restored.load_state_dict(torch.load(buffer))
    assert restored.residual.keys() == feedback.residual.keys()
    for name, residual in feedback.residual.items():
        assert torch.equal(restored.residual[name], residual)
    (delta,) = deltas(1, seed=1)
    for name, tensor in feedback.compensate(delta).items():
        assert torch.equal(restored.compensate(delta)[name], tensor)


def test_state_dict_is_a_snapshot() -> None:
    feedback = ErrorFeedback()
    feedback.update({"w": torch.ones(2)}, {"w": torch.zeros(2)})
    state = feedback.state_dict()
    feedback.update({"w": torch.ones(2)}, {"w": torch.ones(2)})
    assert state["residual"]["w"].tolist() == [1.0, 1.0]  # type: ignore[index]


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"version": 2, "residual": {}}, "state version 2 is not 1"),
        ({"version": 1}, "has no 'residual' mapping"),
        ({"version": 1, "residual": {"w": torch.ones(2).double()}}, "is torch.float64"),
        ({"version": 1, "residual": {"w": torch.tensor([math.nan])}}, "holds NaN or Inf"),
        ({"version": 1, "residual": {"w": [1.0]}}, "is not a floating-point tensor"),
        ({"version": 1, "residual": {"": torch.ones(1)}}, "must be a non-empty string"),
    ],
)
def test_invalid_state_is_refused_and_changes_nothing(
    state: dict[str, object], message: str
) -> None:
    feedback = ErrorFeedback()
    feedback.update({"w": torch.ones(2)}, {"w": torch.zeros(2)})
    with pytest.raises(ErrorFeedbackError, match=message):
        feedback.load_state_dict(state)
    assert feedback.residual["w"].tolist() == [1.0, 1.0]


def test_mismatched_shapes_and_names_are_refused() -> None:
    feedback = ErrorFeedback()
    feedback.update({"w": torch.ones(2)}, {"w": torch.zeros(2)})
    with pytest.raises(ErrorFeedbackError, match="'w': shapes \\(2,\\) and \\(3,\\) differ"):
        feedback.compensate({"w": torch.ones(3)})
    with pytest.raises(ErrorFeedbackError, match="differ in tensors \\['v'\\]"):
        feedback.update({"w": torch.ones(2), "v": torch.ones(1)}, {"w": torch.ones(2)})
    with pytest.raises(ErrorFeedbackError, match="'w': shapes"):
        feedback.update(
            {"v": torch.ones(1), "w": torch.ones(2)}, {"v": torch.zeros(1), "w": torch.ones(3)}
        )
    # Nothing changed: 'v' was not stored although it came first in a valid pair.
    assert set(feedback.residual) == {"w"}


def test_reset_forgets_the_residual() -> None:
    feedback = ErrorFeedback()
    feedback.update({"w": torch.ones(2)}, {"w": torch.zeros(2)})
    feedback.reset()
    assert feedback.residual == {}


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("scheme", ["fp32", "int8", "int4"])
def test_step_gives_the_bytes_and_residual_of_decoding_each_round_on_the_host(
    scheme: Scheme, device: str
) -> None:
    config = CodecParams(scheme=scheme, block_size=64)
    feedback = ErrorFeedback()
    residual: dict[str, torch.Tensor] = {}
    for delta in deltas(4):
        delta = {name: tensor.to(device) for name, tensor in delta.items()}
        # The reference: compensate, encode, decode the whole stream, subtract.
        compensated = {
            name: tensor.float() + residual[name] if residual else tensor.float()
            for name, tensor in delta.items()
        }
        stream = encode_stream(compensated, config)
        decoded = decode(stream.to_bytes())
        residual = {name: compensated[name] - decoded[name].to(device) for name in compensated}
        assert feedback.step(delta, config).to_bytes() == stream.to_bytes()
        for name, tensor in residual.items():
            assert feedback.residual[name].device == tensor.device
            assert torch.equal(feedback.residual[name].view(torch.int32), tensor.view(torch.int32))
