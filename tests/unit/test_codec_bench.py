"""The codec benchmark's own logic (its end-to-end run is in
``tests/integration/test_codec_bench_run.py``)."""

from __future__ import annotations

import torch

from benchmarks import codec_bench
from geofed.codec import encode_stream
from geofed.codec_params import CodecParams


def test_heavy_tailed_data_has_heavier_tails_than_normal() -> None:
    def kurtosis(tensors: dict[str, torch.Tensor]) -> float:
        flat = torch.cat([t.reshape(-1) for t in tensors.values()]).double()
        centred = flat - flat.mean()
        return float((centred**4).mean() / (centred**2).mean() ** 2)

    assert abs(kurtosis(codec_bench.gaussian_delta(1 << 16)) - 3) < 0.2
    assert kurtosis(codec_bench.heavy_tailed_delta(1 << 16)) > 20


def test_chunk_count_reads_the_frames() -> None:
    stream = encode_stream(
        {"a": torch.ones(300), "b": torch.ones(5)}, CodecParams(block_size=16), chunk_elements=128
    )
    assert codec_bench.chunk_count(stream.to_bytes()) == len(stream.chunks) == 4


def test_naive_quantizer_round_trips_within_half_a_step() -> None:
    flat = torch.randn(1024, generator=torch.Generator().manual_seed(0))
    scales, codes = codec_bench.naive_quantize(flat, 128)
    error = (codec_bench.naive_dequantize(scales, codes) - flat).abs().view(-1, 128)
    assert bool((error <= scales.float() * 0.51).all())
