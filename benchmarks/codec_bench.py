"""Delta codec benchmark: throughput, compression ratio and peak memory.

    python -m benchmarks.codec_bench [--sizes 1M,16M,64M] [--quick] [--repeats N]
        [--zstd-levels 1] [--workers 1] [--train-steps 300] [--out PATH]

Throughput is GB/s of float32 input (4 bytes per parameter), for encode
(``encode_stream``), decode (``decode_pieces`` consumed as an aggregator does: each
piece used and dropped) and the round trip, with one torch thread and with all of them.
Each figure is the median of ``--repeats`` runs, by wall clock and by this process's
CPU time: on a shared machine the CPU-time figure ("per core") is the steadier one.

Compression ratios (fp32 bytes / encoded bytes) are measured on Gaussian noise and on a
real pseudo-gradient: θ_before - θ_after of a small transformer LM trained here on
synthetic Markov-chain text for ``--train-steps`` AdamW steps. Baselines run in the same
process: plain zstd of the fp32 bytes at the same level, and quantization alone (no
zstd, no framing). Peak memory is the peak RSS above the RSS before the operation
(from /proc, see :mod:`benchmarks._memory`).

Writes ``benchmarks/results/codec.json`` (with the machine description) and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import zstandard
from torch import nn

from benchmarks._machine import describe_machine, machine_line
from benchmarks._memory import PeakMemory
from geofed.codec import DEFAULT_CHUNK_ELEMENTS, decode, decode_pieces, encode_stream
from geofed.codec.layout import chunk_slots, payload_size
from geofed.codec.quantize import BlockCodec
from geofed.codec_params import CodecParams, Scheme
from geofed.fsutil import atomic_write_bytes

RESULTS = Path(__file__).resolve().parent / "results"
SCHEMES: tuple[Scheme, ...] = ("fp32", "int8", "int4")
LAYER_ELEMENTS = 1 << 22  # Gaussian deltas are cut into "layers" of 4M parameters
GB = 1e9


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def gaussian_delta(params: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for index, offset in enumerate(range(0, params, LAYER_ELEMENTS)):
        count = min(LAYER_ELEMENTS, params - offset)
        tensors[f"layer{index}.weight"] = torch.randn(count, generator=generator) * 1e-3
    return tensors


def fp32_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return 4 * sum(t.numel() for t in tensors.values())


class Timing:
    """Wall and CPU seconds of repeated runs of one operation."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def run(self, operation: Callable[[], object], repeats: int) -> None:
        operation()  # warm-up: buffers, zstd contexts, page faults
        for _ in range(repeats):
            cpu, wall = time.process_time(), time.perf_counter()
            operation()
            self.cpu.append(time.process_time() - cpu)
            self.wall.append(time.perf_counter() - wall)

    def rates(self, size: int) -> dict[str, float]:
        return {
            "wall_s": statistics.median(self.wall),
            "cpu_s": statistics.median(self.cpu),
            "gbps_wall": size / statistics.median(self.wall) / GB,
            "gbps_cpu": size / statistics.median(self.cpu) / GB,
            "gbps_wall_best": size / min(self.wall) / GB,
        }


def consume(pieces: Iterator[Any]) -> None:
    for _ in pieces:
        pass


def measure_codec(
    tensors: dict[str, torch.Tensor], config: CodecParams, repeats: int, workers: int
) -> dict[str, Any]:
    size = fp32_bytes(tensors)
    encode_timing, decode_timing = Timing(), Timing()
    encode_timing.run(lambda: encode_stream(tensors, config, workers=workers), repeats)
    with PeakMemory() as encode_memory:
        stream = encode_stream(tensors, config, workers=workers)
    data = stream.to_bytes()
    decode_timing.run(lambda: consume(decode_pieces(data)), repeats)
    with PeakMemory() as decode_memory:
        consume(decode_pieces(data))
    encode, decode_ = encode_timing.rates(size), decode_timing.rates(size)
    round_trip = size / (encode["wall_s"] + decode_["wall_s"]) / GB
    round_trip_cpu = size / (encode["cpu_s"] + decode_["cpu_s"]) / GB
    return {
        "encode": encode,
        "decode": decode_,
        "round_trip_gbps_wall": round_trip,
        "round_trip_gbps_cpu": round_trip_cpu,
        "encoded_bytes": len(data),
        "ratio": size / len(data),
        "encode_peak_extra_bytes": encode_memory.extra_bytes,
        "decode_peak_extra_bytes": decode_memory.extra_bytes,
        "peak_exact": encode_memory.exact,
    }


def measure_plain_zstd(
    tensors: dict[str, torch.Tensor], level: int, repeats: int
) -> dict[str, Any]:
    """Baseline: zstd of the raw fp32 bytes, tensor by tensor, at the same level."""
    size = fp32_bytes(tensors)
    raw = [t.numpy().data for t in tensors.values()]
    compressor = zstandard.ZstdCompressor(level=level)
    decompressor = zstandard.ZstdDecompressor()
    compressed = [compressor.compress(buffer) for buffer in raw]
    encode_timing, decode_timing = Timing(), Timing()
    encode_timing.run(lambda: [compressor.compress(buffer) for buffer in raw], repeats)
    decode_timing.run(lambda: [decompressor.decompress(frame) for frame in compressed], repeats)
    encoded = sum(len(frame) for frame in compressed)
    return {
        "encode": encode_timing.rates(size),
        "decode": decode_timing.rates(size),
        "encoded_bytes": encoded,
        "ratio": size / encoded,
    }


def measure_quantize_only(
    tensors: dict[str, torch.Tensor], scheme: Scheme, block_size: int, chunk: int, repeats: int
) -> dict[str, Any]:
    """Baseline: blockwise quantization and dequantization alone, chunk by chunk."""
    size = fp32_bytes(tensors)
    codec = BlockCodec(scheme, block_size)
    slices = [
        t.reshape(-1)[o : o + chunk] for t in tensors.values() for o in range(0, t.numel(), chunk)
    ]
    payloads = [codec.encode(s, label="bench", reuse_buffer=False) for s in slices]
    encode_timing, decode_timing = Timing(), Timing()
    encode_timing.run(lambda: [codec.encode(s, label="bench") for s in slices], repeats)
    decode_timing.run(
        lambda: [
            codec.decode(p, s.numel(), label="bench") for p, s in zip(payloads, slices, strict=True)
        ],
        repeats,
    )
    encoded = sum(p.numel() for p in payloads)
    return {
        "encode": encode_timing.rates(size),
        "decode": decode_timing.rates(size),
        "encoded_bytes": encoded,
        "ratio": size / encoded,
    }


# -- a real pseudo-gradient -----------------------------------------------------------


class TinyLM(nn.Module):
    """A 2-layer pre-norm transformer LM over bytes (about 0.5M parameters)."""

    def __init__(self, vocab: int = 256, width: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(1, 64, width))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        hidden = self.embed(tokens) + self.position[:, :length]
        mask = nn.Transformer.generate_square_subsequent_mask(length)
        for block in self.blocks:
            hidden = block(hidden, src_mask=mask, is_causal=True)
        return self.head(self.norm(hidden))  # type: ignore[no-any-return]


def markov_batches(batch: int, length: int, seed: int) -> Iterator[torch.Tensor]:
    """Synthetic text: a sparse random Markov chain over 256 symbols (learnable)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(256, 256, generator=generator) * 3
    transitions = torch.softmax(logits, dim=1)
    while True:
        tokens = torch.empty(batch, length, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, 256, (batch,), generator=generator)
        for step in range(1, length):
            tokens[:, step] = torch.multinomial(
                transitions[tokens[:, step - 1]], 1, generator=generator
            )[:, 0]
        yield tokens


def trained_delta(steps: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """θ_before - θ_after of :class:`TinyLM` after ``steps`` AdamW steps."""
    torch.manual_seed(seed)
    model = TinyLM()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    batches = markov_batches(32, 64, seed)
    losses = []
    for _ in range(steps):
        tokens = next(batches)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    delta = {name: before[name] - p.detach() for name, p in model.named_parameters()}
    info = {
        "parameters": sum(t.numel() for t in delta.values()),
        "steps": steps,
        "loss_first": losses[0],
        "loss_last": statistics.mean(losses[-10:]),
    }
    return delta, info


def measure_ratios(
    tensors: dict[str, torch.Tensor], level: int, block_size: int
) -> list[dict[str, Any]]:
    size = fp32_bytes(tensors)
    rows: list[dict[str, Any]] = []
    reference = torch.cat([t.reshape(-1) for t in tensors.values()]).double()
    for scheme in SCHEMES:
        config = CodecParams(scheme=scheme, block_size=block_size, zstd_level=level)
        stream = encode_stream(tensors, config)
        data = stream.to_bytes()
        decoded = decode(data)
        flat = torch.cat([decoded[name].reshape(-1) for name in tensors]).double()
        # The chunk payloads before zstd, as the stream's own layout sizes them.
        before_zstd = sum(
            payload_size(scheme, slot.count, block_size)
            for slot in chunk_slots(stream.specs, stream.chunk_elements)
        )
        rows.append(
            {
                "scheme": scheme,
                "zstd_level": level,
                "ratio": size / len(data),
                "ratio_quantization_only": size / before_zstd,
                "zstd_gain": before_zstd / len(data),
                "relative_l2_error": float((flat - reference).norm() / reference.norm()),
            }
        )
    compressor = zstandard.ZstdCompressor(level=level)
    plain = sum(len(compressor.compress(t.numpy().data)) for t in tensors.values())
    rows.append({"scheme": "zstd-fp32", "zstd_level": level, "ratio": size / plain})
    return rows


# -- report -----------------------------------------------------------------------------


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Machine: {machine_line(results['machine'])}",
        "",
        "| method | level | params | threads | encode GB/s (wall / per core) | "
        "decode GB/s (wall / per core) | round trip GB/s (per core) | ratio | "
        "enc / dec peak MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["throughput"]:
        peaks = "-"
        if row.get("encode_peak_extra_bytes") is not None:
            encode_mb = row["encode_peak_extra_bytes"] / 2**20
            decode_mb = row["decode_peak_extra_bytes"] / 2**20
            peaks = f"{encode_mb:.0f} / {decode_mb:.0f}"
        trip = f"{row['round_trip_gbps_cpu']:.2f}" if "round_trip_gbps_cpu" in row else "-"
        lines.append(
            f"| {row['method']} | {row['zstd_level']} | {row['params'] / 2**20:g}M "
            f"| {row['threads']} "
            f"| {row['encode']['gbps_wall']:.2f} / {row['encode']['gbps_cpu']:.2f} "
            f"| {row['decode']['gbps_wall']:.2f} / {row['decode']['gbps_cpu']:.2f} "
            f"| {trip} | {row['ratio']:.2f} | {peaks} |"
        )
    lines += [
        "",
        "| data | scheme | level | ratio | before zstd | zstd gain | rel. L2 error |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["compression"]:
        extra = (
            f"{row['ratio_quantization_only']:.2f} | {row['zstd_gain']:.3f} "
            f"| {row['relative_l2_error']:.2e}"
            if "zstd_gain" in row
            else "- | - | -"
        )
        lines.append(
            f"| {row['data']} | {row['scheme']} | {row['zstd_level']} "
            f"| {row['ratio']:.2f} | {extra} |"
        )
    return "\n".join(lines)


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(document, indent=2) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1M,16M,64M", help="parameter counts, e.g. 1M,16M,64M")
    parser.add_argument(
        "--quick", action="store_true", help="1M parameters, 5 repeats, 60 training steps"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--zstd-levels", default="1", help="zstd levels to run, e.g. 1,-1")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="encode_stream workers (default: as many as torch threads in each setting)",
    )
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=RESULTS / "codec.json")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    repeats, steps = args.repeats, args.train_steps
    if args.quick:
        sizes, repeats, steps = [1 << 20], 5, 60
    levels = [int(level) for level in args.zstd_levels.split(",")]
    all_threads = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    thread_counts = sorted({1, all_threads})
    machine = describe_machine()

    throughput: list[dict[str, Any]] = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for params in sizes:
            tensors = gaussian_delta(params)
            workers = args.workers or threads
            common = {"params": params, "threads": threads, "workers": workers}
            for level in levels:
                for scheme in SCHEMES:
                    config = CodecParams(
                        scheme=scheme, block_size=args.block_size, zstd_level=level
                    )
                    row = measure_codec(tensors, config, repeats, workers)
                    throughput.append({"method": scheme, "zstd_level": level, **common, **row})
                    print(
                        f"# {scheme} level {level} {params} params {threads} threads: "
                        f"encode {row['encode']['gbps_cpu']:.2f} "
                        f"decode {row['decode']['gbps_cpu']:.2f} "
                        f"GB/s per core, ratio {row['ratio']:.2f}",
                        file=sys.stderr,
                    )
                plain = measure_plain_zstd(tensors, level, repeats)
                throughput.append(
                    {"method": "zstd-fp32 (baseline)", "zstd_level": level, **common, **plain}
                )
            for scheme in ("int8", "int4"):
                chunk = DEFAULT_CHUNK_ELEMENTS
                only = measure_quantize_only(tensors, scheme, args.block_size, chunk, repeats)
                throughput.append(
                    {
                        "method": f"{scheme} quantize only (baseline)",
                        "zstd_level": "-",
                        **common,
                        **only,
                    }
                )
            del tensors
    torch.set_num_threads(all_threads)

    compression: list[dict[str, Any]] = []
    delta, training = trained_delta(steps)
    gaussian = gaussian_delta(min(sizes))
    for level in levels:
        for data_name, tensors in (("gaussian", gaussian), ("trained transformer delta", delta)):
            compression += [
                {"data": data_name, **row}
                for row in measure_ratios(tensors, level, args.block_size)
            ]

    results = {
        "benchmark": "codec",
        "machine": {
            **describe_machine(),
            "load_average_at_start": machine["load_average_1_5_15min"],
        },
        "settings": {
            "sizes": sizes,
            "repeats": repeats,
            "zstd_levels": levels,
            "block_size": args.block_size,
            "workers": args.workers or "same as threads",
            "quick": args.quick,
            "statistic": "median of repeats; gbps_cpu = fp32 bytes / process CPU seconds",
        },
        "training": training,
        "throughput": throughput,
        "compression": compression,
    }
    write_json(args.out, results)
    print(markdown(results))
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0 if all(math.isfinite(row["ratio"]) for row in throughput) else 1


if __name__ == "__main__":
    sys.exit(main())
