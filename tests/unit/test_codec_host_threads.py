"""The codec's host ops run on the calling thread alone, and leave other threads as they were."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from geofed.codec.host_threads import _omp_setter, one_thread
from geofed.codec.quantize import BlockCodec

OPENMP = "OpenMP" in torch.__config__.parallel_info()


@pytest.fixture
def four_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_one_thread_limits_the_calling_thread_only(four_threads: None) -> None:
    # The project installs torch's CPU build, which runs on OpenMP.
    assert OPENMP, "this torch runs without OpenMP: install the pinned build (make setup)"
    assert _omp_setter() is not None  # torch's OpenMP runtime was found
    inside: list[int] = []
    elsewhere: list[int] = []
    with one_thread():
        inside.append(torch.get_num_threads())
        other = threading.Thread(target=lambda: elsewhere.append(torch.get_num_threads()))
        other.start()
        other.join()
    assert inside == [1]
    assert elsewhere == [4]  # a thread starting meanwhile keeps the configured count
    assert torch.get_num_threads() == 4


def test_one_thread_restores_the_count_after_an_error(four_threads: None) -> None:
    with pytest.raises(RuntimeError, match="boom"), one_thread():
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 4


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp32"])
def test_codec_ops_see_one_thread_and_give_the_same_bits(scheme: str, four_threads: None) -> None:
    flat = torch.randn(300_001, generator=torch.Generator().manual_seed(3))
    seen: list[int] = []
    codec = BlockCodec(scheme, 128)  # type: ignore[arg-type]
    original = codec._quantize_blocks

    def spy(*args: object, **kwargs: object) -> None:
        seen.append(torch.get_num_threads())
        original(*args, **kwargs)  # type: ignore[arg-type]

    codec._quantize_blocks = spy  # type: ignore[method-assign]
    payload = codec.encode(flat, label="x", reuse_buffer=False).clone()
    values = codec.decode(payload, flat.numel(), label="x")
    if scheme != "fp32" and OPENMP:
        assert set(seen) == {1}
    torch.set_num_threads(1)
    reference = BlockCodec(scheme, 128)  # type: ignore[arg-type]
    again = reference.encode(flat, label="x", reuse_buffer=False)
    assert torch.equal(payload, again)
    assert torch.equal(values, reference.decode(again, flat.numel(), label="x"))
