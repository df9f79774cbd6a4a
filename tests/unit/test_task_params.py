"""Model-state helpers: the parameter hash every region must agree on, and fp32 copies."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch
from torch import nn

from geofed.params import (
    check_federated_state,
    count_parameters,
    federated_names,
    federated_state,
    load_federated_state,
    model_state,
    parameters_vector_hash,
    state_to_fp32,
)


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


def test_module_hash_equals_its_federated_state_dict_hash() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    floats = {k: v for k, v in model.state_dict().items() if k != "1.num_batches_tracked"}
    assert parameters_vector_hash(model) == parameters_vector_hash(floats)
    assert "1.running_mean" in model_state(model)
    assert "1.num_batches_tracked" not in model_state(model)


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


class _Rotary(nn.Module):
    """A float weight and buffer beside a complex64 table and an int64 counter."""

    scale: torch.Tensor
    freqs_cis: torch.Tensor
    seen: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 0.5))
        angles = torch.arange(6, dtype=torch.float32).reshape(3, 2)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))
        self.register_buffer("seen", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def _rotary(seed: int = 0) -> _Rotary:
    torch.manual_seed(seed)
    return _Rotary()


def test_federated_state_is_the_floating_persistent_state() -> None:
    model = _rotary()
    assert model.freqs_cis.dtype == torch.complex64
    assert set(model.state_dict()) == {"proj.weight", "proj.bias", "scale", "freqs_cis", "seen"}
    expected = {"proj.weight", "proj.bias", "scale"}
    assert set(federated_state(model)) == expected
    assert federated_names(model) == expected
    assert set(federated_state(model.state_dict())) == expected
    assert set(state_to_fp32(model)) == expected
    assert federated_state(model)["proj.weight"].data_ptr() == model.proj.weight.data_ptr()


def test_federated_state_hash_ignores_rebuilt_buffers() -> None:
    model = _rotary()
    digest = parameters_vector_hash(model)
    assert digest == parameters_vector_hash(state_to_fp32(model))
    assert digest == parameters_vector_hash(_rotary())
    model.seen.add_(1)
    with torch.no_grad():
        model.freqs_cis.mul_(2)
    assert parameters_vector_hash(model) == digest
    with torch.no_grad():
        model.scale.add_(1.0)
    assert parameters_vector_hash(model) != digest


def test_load_federated_state_copies_exactly_the_federated_tensors() -> None:
    source, target = _rotary(1), _rotary(2)
    target.seen.add_(5)
    table = target.freqs_cis.clone()
    check_federated_state(target, state_to_fp32(source))
    load_federated_state(target, state_to_fp32(source))
    assert parameters_vector_hash(target) == parameters_vector_hash(source)
    assert torch.equal(target.freqs_cis, table)
    assert int(target.seen) == 5


def test_load_federated_state_casts_to_the_model_dtype() -> None:
    source, target = _rotary(1), _rotary(2)
    target.proj.to(torch.bfloat16)
    load_federated_state(target, state_to_fp32(source))
    assert target.proj.weight.dtype == torch.bfloat16
    assert target.freqs_cis.dtype == torch.complex64
    assert torch.equal(target.proj.weight, source.proj.weight.to(torch.bfloat16))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.pop("scale"), r"missing \['scale'\], unexpected \[\]"),
        (lambda s: s.update(extra=torch.zeros(1)), r"missing \[\], unexpected \['extra'\]"),
        (lambda s: s.update(scale=torch.zeros(5)), r"scale: \(5,\) != \(4,\)"),
    ],
)
def test_load_federated_state_is_strict_before_copying(change: object, message: str) -> None:
    source, target = _rotary(1), _rotary(2)
    state = state_to_fp32(source)
    assert callable(change)
    change(state)
    before = parameters_vector_hash(target)
    with pytest.raises(ValueError, match=message):
        check_federated_state(target, state)
    with pytest.raises(ValueError, match=message):
        load_federated_state(target, state)
    assert parameters_vector_hash(target) == before


def test_load_federated_state_refuses_a_rebuilt_buffer() -> None:
    source, target = _rotary(1), _rotary(2)
    state = dict(source.state_dict())
    with pytest.raises(ValueError, match=r"unexpected \['freqs_cis', 'seen'\]"):
        load_federated_state(target, state)


def test_count_parameters_looks_through_nothing_but_parameters() -> None:
    assert count_parameters(_rotary()) == 4 * 4 + 4
