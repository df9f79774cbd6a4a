"""Model-state helpers: the parameter hash every region must agree on, and fp32 copies."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch
from torch import nn

from geofed.params import model_state, parameters_vector_hash, state_to_fp32


def _state() -> dict[str, torch.Tensor]:
    return {
        "b.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "a.bias": torch.tensor([0.5, -1.0], dtype=torch.float32),
        "steps": torch.tensor(3, dtype=torch.int64),
    }


def test_known_answer_pins_the_format() -> None:
    # Regions on other machines and versions must produce this exact digest; the byte
    # stream is spelled out here independently of the implementation.
    def field(data: bytes) -> bytes:
        return struct.pack("<Q", len(data)) + data

    stream = b"geofed-params-v1\0" + struct.pack("<Q", 3)
    stream += field(b"a.bias") + field(b"torch.float32") + field(struct.pack("<Q", 2))
    stream += field(struct.pack("<2f", 0.5, -1.0))
    stream += field(b"b.weight") + field(b"torch.float32") + field(struct.pack("<2Q", 2, 3))
    stream += field(struct.pack("<6f", 0, 1, 2, 3, 4, 5))
    stream += field(b"steps") + field(b"torch.int64") + field(b"") + field(struct.pack("<q", 3))
    expected = hashlib.sha256(stream).hexdigest()
    assert parameters_vector_hash(_state()) == expected
    assert expected == "dd2ad27059d03d19da53631a37dbee337f87d3f01fee69060d1ae0dcc2b39121"


def test_insertion_order_does_not_matter() -> None:
    state = _state()
    reversed_state = dict(reversed(list(state.items())))
    assert parameters_vector_hash(state) == parameters_vector_hash(reversed_state)


def test_one_bit_changes_the_hash() -> None:
    state = _state()
    before = parameters_vector_hash(state)
    weight = state["b.weight"]
    weight[1, 2] = torch.nextafter(weight[1, 2], torch.tensor(100.0))
    assert parameters_vector_hash(state) != before


def test_negative_zero_differs_from_zero() -> None:
    assert parameters_vector_hash({"x": torch.tensor([0.0])}) != parameters_vector_hash(
        {"x": torch.tensor([-0.0])}
    )


def test_name_dtype_and_shape_are_hashed() -> None:
    base = torch.arange(6, dtype=torch.int32)
    reference = parameters_vector_hash({"x": base})
    assert parameters_vector_hash({"y": base}) != reference
    assert parameters_vector_hash({"x": base.view(torch.float32)}) != reference
    assert parameters_vector_hash({"x": base.reshape(2, 3)}) != reference
    assert parameters_vector_hash({"x": base.reshape(3, 2)}) != parameters_vector_hash(
        {"x": base.reshape(2, 3)}
    )


def test_tensor_boundaries_are_unambiguous() -> None:
    # Same concatenated bytes, split differently between two tensors.
    left = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}
    right = {"a": torch.tensor([1.0]), "b": torch.tensor([2.0, 3.0])}
    assert parameters_vector_hash(left) != parameters_vector_hash(right)


def test_layout_does_not_matter() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    transposed = base.t()
    assert not transposed.is_contiguous()
    assert parameters_vector_hash({"x": transposed}) == parameters_vector_hash(
        {"x": transposed.contiguous()}
    )


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor(1.5),
        torch.zeros(0, 3),
        torch.ones(4, dtype=torch.bfloat16),
        torch.ones(4, dtype=torch.float16),
        torch.tensor([True, False]),
    ],
)
def test_unusual_tensors_hash(tensor: torch.Tensor) -> None:
    digest = parameters_vector_hash({"t": tensor})
    assert len(digest) == 64
    assert digest == parameters_vector_hash({"t": tensor.clone()})


def test_module_hash_equals_its_state_dict_hash() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    assert parameters_vector_hash(model) == parameters_vector_hash(model.state_dict())
    assert "1.running_mean" in model_state(model)


def test_non_tensor_entry_is_refused() -> None:
    with pytest.raises(TypeError, match="'x' is list"):
        parameters_vector_hash({"x": [1.0]})  # type: ignore[dict-item]


def test_state_to_fp32_converts_floats_and_keeps_integers() -> None:
    state = {
        "h": torch.tensor([1.5, -2.25], dtype=torch.float16),
        "b": torch.tensor([0.5], dtype=torch.bfloat16),
        "n": torch.tensor(7, dtype=torch.int64),
    }
    out = state_to_fp32(state)
    assert out["h"].dtype == torch.float32
    assert out["b"].dtype == torch.float32
    assert out["n"].dtype == torch.int64
    assert out["h"].tolist() == [1.5, -2.25]
    assert out["b"].tolist() == [0.5]


def test_state_to_fp32_is_a_detached_copy() -> None:
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    snapshot = state_to_fp32(model)
    before = parameters_vector_hash(snapshot)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert parameters_vector_hash(snapshot) == before
    assert not snapshot["weight"].requires_grad
    assert snapshot["weight"].data_ptr() != model.weight.data_ptr()
