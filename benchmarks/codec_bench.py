"""Delta codec benchmark: throughput, compression ratio and peak memory.

    python -m benchmarks.codec_bench [--sizes 1M,16M] [--quick] [--repeats N]
        [--zstd-levels 1] [--workers 1] [--zstd-threads 0] [--train-steps 300] [--out PATH]

Throughput is GB/s of float32 input (4 bytes per parameter), for encode
(``encode_stream``), decode (``decode_pieces`` consumed as an aggregator does: each
piece used and dropped) and encode + decode (the fp32 bytes over the two times added),
with one torch thread and with all of them. Each figure is the median of ``--repeats``
runs, by wall clock and by this process's CPU time: on a shared machine the CPU-time
figure ("per core") is the steadier one.

Every scheme runs on two kinds of delta, Gaussian ("normal") and heavy-tailed (Student's
t with 2 degrees of freedom: most codes of a block near zero, which zstd compresses),
under each compression policy of the encoder: ``zstd`` (every chunk compressed, what the
codec did before per-chunk compression), ``none`` (every payload stored as it is) and
``auto`` (the default: zstd where it pays). Baselines run in the same process: plain zstd
of the fp32 bytes at the same level, the codec's quantization alone (no zstd, no framing,
no hashing) and a naive torch quantizer (a few whole-tensor ops per chunk, no buffers).
With CUDA, a CUDA section compares the codec's quantization of a device tensor (payload
copied to the host) with a plain one-pass quantize and device-to-host copy.

Compression ratios (fp32 bytes / encoded bytes) are also measured on a real
pseudo-gradient: θ_before - θ_after of a small transformer LM trained here on synthetic
Markov-chain text for ``--train-steps`` AdamW steps. Peak memory is the peak RSS above
the RSS before the operation (from /proc, see :mod:`benchmarks._memory`).

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

from benchmarks._machine import describe_machine, machine_line, targets_table
from benchmarks._memory import PeakMemory
from geofed.codec import DEFAULT_CHUNK_ELEMENTS, decode, decode_pieces, encode_stream
from geofed.codec.compression import CompressionPolicy
from geofed.codec.layout import chunk_slots, payload_size
from geofed.codec.quantize import QMAX, BlockCodec
from geofed.codec.wire import CHUNK_FIELDS, PREFIX, Compression, parse_chunk_fields
from geofed.codec_params import CodecParams, Scheme
from geofed.fsutil import atomic_write_bytes

RESULTS = Path(__file__).resolve().parent / "results"
SCHEMES: tuple[Scheme, ...] = ("fp32", "int8", "int4")
POLICIES: tuple[CompressionPolicy, ...] = ("zstd", "none", "auto")
LAYER_ELEMENTS = 1 << 22  # synthetic deltas are cut into "layers" of 4M parameters
GB = 1e9
# int8 encode + decode >= 1.5 GB/s of fp32 per core: framing, zstd and hashing may cost
# no more than the quantization (the design asked for 1 GB/s).
TARGET_GBPS = 1.5


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _layers(params: int, draw: Callable[[int], torch.Tensor]) -> dict[str, torch.Tensor]:
    tensors = {}
    for index, offset in enumerate(range(0, params, LAYER_ELEMENTS)):
        count = min(LAYER_ELEMENTS, params - offset)
        tensors[f"layer{index}.weight"] = draw(count) * 1e-3
    return tensors


def gaussian_delta(params: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return _layers(params, lambda count: torch.randn(count, generator=generator))


def heavy_tailed_delta(params: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Student's t with 2 degrees of freedom: z / sqrt((a^2 + b^2) / 2), z, a, b ~ N(0, 1)."""
    generator = torch.Generator().manual_seed(seed)

    def draw(count: int) -> torch.Tensor:
        z, a, b = (torch.randn(count, generator=generator) for _ in range(3))
        return z / ((a * a + b * b) / 2).sqrt()

    return _layers(params, draw)


DATASETS: dict[str, Callable[[int], dict[str, torch.Tensor]]] = {
    "normal": gaussian_delta,
    "heavy-tailed": heavy_tailed_delta,
}


def fp32_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return 4 * sum(t.numel() for t in tensors.values())


class Timing:
    """Wall and CPU seconds of repeated runs of one operation."""

    def __init__(self, *, synchronize: Callable[[], None] | None = None) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._synchronize = synchronize or (lambda: None)

    def run(self, operation: Callable[[], object], repeats: int) -> None:
        operation()  # warm-up: buffers, zstd contexts, page faults
        self._synchronize()
        for _ in range(repeats):
            cpu, wall = time.process_time(), time.perf_counter()
            operation()
            self._synchronize()
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


def round_trip(encode: dict[str, float], decode_: dict[str, float], size: int) -> dict[str, float]:
    """Encode + decode: the fp32 bytes over the two median times added."""
    return {
        "round_trip_gbps_wall": size / (encode["wall_s"] + decode_["wall_s"]) / GB,
        "round_trip_gbps_cpu": size / (encode["cpu_s"] + decode_["cpu_s"]) / GB,
    }


def measure_codec(
    tensors: dict[str, torch.Tensor],
    config: CodecParams,
    policy: CompressionPolicy,
    repeats: int,
    workers: int,
    zstd_threads: int = 0,
) -> dict[str, Any]:
    size = fp32_bytes(tensors)
    options: dict[str, Any] = {
        "workers": workers,
        "compression": policy,
        "zstd_threads": zstd_threads,
    }
    encode_timing, decode_timing = Timing(), Timing()
    encode_timing.run(lambda: encode_stream(tensors, config, **options), repeats)
    with PeakMemory() as encode_memory:
        stream = encode_stream(tensors, config, **options)
    data = stream.to_bytes()
    compressed = sum(
        parse_chunk_fields(chunk.data[PREFIX.size :]).compression == Compression.ZSTD
        for chunk in stream.chunks
    )
    del stream
    decode_timing.run(lambda: consume(decode_pieces(data)), repeats)
    with PeakMemory() as decode_memory:
        consume(decode_pieces(data))
    encode, decode_ = encode_timing.rates(size), decode_timing.rates(size)
    chunks = chunk_count(data)
    return {
        "encode": encode,
        "decode": decode_,
        **round_trip(encode, decode_, size),
        "encoded_bytes": len(data),
        "ratio": size / len(data),
        "zstd_chunk_fraction": compressed / chunks if chunks else 0.0,
        "encode_peak_extra_bytes": encode_memory.extra_bytes,
        "decode_peak_extra_bytes": decode_memory.extra_bytes,
        "peak_exact": encode_memory.exact,
    }


def chunk_count(data: bytes) -> int:
    """Frames in a stream, less its header and trailer."""
    frames, position = 0, 0
    while position < len(data):
        position += PREFIX.size + PREFIX.unpack_from(data, position)[4] + 32
        frames += 1
    return frames - 2


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
    encode, decode_ = encode_timing.rates(size), decode_timing.rates(size)
    return {
        "encode": encode,
        "decode": decode_,
        **round_trip(encode, decode_, size),
        "encoded_bytes": encoded,
        "ratio": size / encoded,
    }


def _slices(tensors: dict[str, torch.Tensor], chunk: int) -> list[torch.Tensor]:
    return [
        t.reshape(-1)[o : o + chunk] for t in tensors.values() for o in range(0, t.numel(), chunk)
    ]


def measure_quantize_only(
    tensors: dict[str, torch.Tensor], scheme: Scheme, block_size: int, chunk: int, repeats: int
) -> dict[str, Any]:
    """Baseline: the codec's blockwise quantization and dequantization alone, per chunk."""
    size = fp32_bytes(tensors)
    codec = BlockCodec(scheme, block_size)
    slices = _slices(tensors, chunk)
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
    encode, decode_ = encode_timing.rates(size), decode_timing.rates(size)
    return {
        "encode": encode,
        "decode": decode_,
        **round_trip(encode, decode_, size),
        "encoded_bytes": encoded,
        "ratio": size / encoded,
    }


def naive_quantize(flat: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch blockwise int8: a few whole-slice ops, temporaries everywhere."""
    blocks = flat.view(-1, block_size)
    scales = (blocks.abs().amax(dim=1, keepdim=True) / 127).clamp(min=2.0**-120)
    scales = scales.to(torch.bfloat16)
    codes = torch.round(blocks / scales.float()).clamp(-127, 127).to(torch.int8)
    return scales, codes


def naive_dequantize(scales: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    return (codes.to(torch.float32) * scales.to(torch.float32)).reshape(-1)


def measure_naive(
    tensors: dict[str, torch.Tensor], block_size: int, chunk: int, repeats: int
) -> dict[str, Any]:
    """Baseline: :func:`naive_quantize` per chunk (whole blocks only), no zstd, no framing."""
    size = fp32_bytes(tensors)
    slices = [s[: s.numel() // block_size * block_size] for s in _slices(tensors, chunk)]
    encoded = [naive_quantize(s, block_size) for s in slices]
    encode_timing, decode_timing = Timing(), Timing()
    encode_timing.run(lambda: [naive_quantize(s, block_size) for s in slices], repeats)
    decode_timing.run(lambda: [naive_dequantize(*pair) for pair in encoded], repeats)
    encode, decode_ = encode_timing.rates(size), decode_timing.rates(size)
    payload = sum(2 * scales.numel() + codes.numel() for scales, codes in encoded)
    return {
        "encode": encode,
        "decode": decode_,
        **round_trip(encode, decode_, size),
        "encoded_bytes": payload,
        "ratio": size / payload,
    }


def measure_cuda(params: int, block_size: int, repeats: int) -> list[dict[str, Any]]:
    """On the GPU: the codec's quantization (payload to the host) vs a plain one-pass one.

    Both start from a float32 delta on the device and end with the int8 payload in host
    memory; ``encode_stream`` adds hashing, framing and the compression policy.
    """
    device = torch.device("cuda")
    tensors = {name: t.to(device) for name, t in gaussian_delta(params).items()}
    size = fp32_bytes(tensors)
    chunk = DEFAULT_CHUNK_ELEMENTS
    slices = _slices(tensors, chunk)
    qmax = QMAX["int8"]

    def plain() -> None:
        for flat in slices:
            blocks = flat[: flat.numel() // block_size * block_size].view(-1, block_size)
            scales = blocks.abs().amax(dim=1, keepdim=True).div_(qmax)
            codes = torch.round(blocks / scales).to(torch.int8)
            codes.cpu(), scales.to(torch.bfloat16).cpu()

    codec = BlockCodec("int8", block_size)
    config = CodecParams(scheme="int8", block_size=block_size)
    operations: dict[str, Callable[[], object]] = {
        "plain one-pass quantize + D2H (baseline)": plain,
        "codec quantize + D2H": lambda: [codec.encode(s, label="bench") for s in slices],
        "encode_stream (auto)": lambda: encode_stream(tensors, config),
    }
    rows = []
    for method, operation in operations.items():
        timing = Timing(synchronize=torch.cuda.synchronize)
        timing.run(operation, repeats)
        rows.append({"method": method, "params": params, "encode": timing.rates(size)})
    return rows


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
        streams = {
            policy: encode_stream(tensors, config, compression=policy) for policy in POLICIES
        }
        data = streams["auto"].to_bytes()
        decoded = decode(data)
        flat = torch.cat([decoded[name].reshape(-1) for name in tensors]).double()
        # The chunk payloads before zstd, as the stream's own layout sizes them.
        stream = streams["zstd"]
        before_zstd = sum(
            payload_size(scheme, slot.count, block_size)
            for slot in chunk_slots(stream.specs, stream.chunk_elements)
        )
        rows.append(
            {
                "scheme": scheme,
                "zstd_level": level,
                "ratio": size / len(data),
                "ratio_zstd": size / stream.total_bytes,
                "ratio_none": size / streams["none"].total_bytes,
                "ratio_quantization_only": size / before_zstd,
                "zstd_gain": before_zstd / (stream.total_bytes - _framing(stream)),
                "relative_l2_error": float((flat - reference).norm() / reference.norm()),
            }
        )
    compressor = zstandard.ZstdCompressor(level=level)
    plain = sum(len(compressor.compress(t.numpy().data)) for t in tensors.values())
    rows.append({"scheme": "zstd-fp32", "zstd_level": level, "ratio": size / plain})
    return rows


def _framing(stream: Any) -> int:
    """Bytes of a stream that are not chunk payloads: header, trailer, chunk fields, tags."""
    per_chunk = PREFIX.size + CHUNK_FIELDS.size + 32
    return len(stream.header) + len(stream.trailer) + per_chunk * len(stream.chunks)


# -- report -----------------------------------------------------------------------------


def _pair(row: dict[str, Any], key: str) -> str:
    return f"{row[key]['gbps_wall']:.2f} / {row[key]['gbps_cpu']:.2f}"


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Machine: {machine_line(results['machine'])}",
        "",
        "GB/s of fp32 input, wall / per core (CPU time); encode + decode = fp32 bytes over "
        "the two times added.",
        "",
        "| data | method | compression | params | threads | encode | decode | "
        "encode + decode | ratio | zstd chunks | enc / dec peak MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["throughput"]:
        peaks = "-"
        if row.get("encode_peak_extra_bytes") is not None:
            encode_mb = row["encode_peak_extra_bytes"] / 2**20
            decode_mb = row["decode_peak_extra_bytes"] / 2**20
            peaks = f"{encode_mb:.0f} / {decode_mb:.0f}"
        fraction = row.get("zstd_chunk_fraction")
        zstd_chunks = "-" if fraction is None else f"{fraction:.0%}"
        trip = f"{row['round_trip_gbps_wall']:.2f} / {row['round_trip_gbps_cpu']:.2f}"
        lines.append(
            f"| {row['data']} | {row['method']} | {row['compression']} "
            f"| {row['params'] / 2**20:g}M | {row['threads']} "
            f"| {_pair(row, 'encode')} | {_pair(row, 'decode')} | {trip} "
            f"| {row['ratio']:.2f} | {zstd_chunks} | {peaks} |"
        )
    if results.get("cuda"):
        lines += [
            "",
            "| CUDA (int8, device tensor to host payload) | params | GB/s (wall) |",
            "|---|---|---|",
        ]
        for row in results["cuda"]:
            lines.append(
                f"| {row['method']} | {row['params'] / 2**20:g}M "
                f"| {row['encode']['gbps_wall']:.2f} |"
            )
    lines += [
        "",
        "| data | scheme | level | ratio (auto) | zstd every chunk | no zstd | "
        "quantization only | zstd gain | rel. L2 error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["compression"]:
        extra = (
            f"{row['ratio_zstd']:.2f} | {row['ratio_none']:.2f} "
            f"| {row['ratio_quantization_only']:.2f} | {row['zstd_gain']:.3f} "
            f"| {row['relative_l2_error']:.2e}"
            if "zstd_gain" in row
            else "- | - | - | - | -"
        )
        lines.append(
            f"| {row['data']} | {row['scheme']} | {row['zstd_level']} "
            f"| {row['ratio']:.2f} | {extra} |"
        )
    lines += targets_table(results["targets"])
    return "\n".join(lines)


def targets(throughput: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """int8 encode + decode >= TARGET_GBPS of fp32 per core (one thread, default policy)."""
    checks = []
    for data in DATASETS:
        rows = [
            row
            for row in throughput
            if row["data"] == data
            and row["method"] == "int8"
            and row["compression"] == "auto"
            and row["threads"] == 1
        ]
        if not rows:
            continue
        row = max(rows, key=lambda r: r["params"])
        figure = row["round_trip_gbps_cpu"]
        checks.append(
            {
                "name": f"int8 encode + decode >= {TARGET_GBPS:g} GB/s of fp32 per core "
                f"({data}, default compression)",
                "measured": f"{figure:.2f} GB/s per core at {row['params'] / 2**20:g}M "
                f"parameters (ratio {row['ratio']:.2f})",
                "value": figure,
                "met": figure >= TARGET_GBPS,
            }
        )
    return checks


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(document, indent=2) + "\n").encode())


def _log(label: str, row: dict[str, Any]) -> None:
    print(
        f"# {label}: encode {row['encode']['gbps_cpu']:.2f} "
        f"decode {row['decode']['gbps_cpu']:.2f} "
        f"encode+decode {row['round_trip_gbps_cpu']:.2f} GB/s per core, "
        f"ratio {row['ratio']:.2f}",
        file=sys.stderr,
        flush=True,
    )


def baselines(
    tensors: dict[str, torch.Tensor], block_size: int, repeats: int
) -> Iterator[tuple[str, dict[str, Any]]]:
    chunk = DEFAULT_CHUNK_ELEMENTS
    yield (
        "int8 naive torch quantizer (baseline)",
        measure_naive(tensors, block_size, chunk, repeats),
    )
    for scheme in ("int8", "int4"):
        yield (
            f"{scheme} quantize only (baseline)",
            measure_quantize_only(tensors, scheme, block_size, chunk, repeats),
        )


def measure_throughput(
    sizes: list[int],
    levels: list[int],
    thread_counts: list[int],
    args: argparse.Namespace,
    repeats: int,
) -> list[dict[str, Any]]:
    throughput: list[dict[str, Any]] = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for params in sizes:
            for data, make in DATASETS.items():
                tensors = make(params)
                workers = args.workers or threads
                common = {"data": data, "params": params, "threads": threads, "workers": workers}
                for level in levels:
                    for scheme in SCHEMES:
                        config = CodecParams(
                            scheme=scheme, block_size=args.block_size, zstd_level=level
                        )
                        for policy in POLICIES:
                            row = measure_codec(
                                tensors, config, policy, repeats, workers, args.zstd_threads
                            )
                            throughput.append(
                                {
                                    "method": scheme,
                                    "compression": policy,
                                    "zstd_level": level,
                                    "zstd_threads": args.zstd_threads,
                                    **common,
                                    **row,
                                }
                            )
                            _log(f"{data} {scheme} {policy} {params} params {threads} threads", row)
                    plain = measure_plain_zstd(tensors, level, repeats)
                    throughput.append(
                        {
                            "method": "zstd-fp32 (baseline)",
                            "compression": f"zstd {level}",
                            "zstd_level": level,
                            **common,
                            **plain,
                        }
                    )
                for method, row in baselines(tensors, args.block_size, repeats):
                    throughput.append({"method": method, "compression": "-", **common, **row})
                    _log(f"{data} {method} {params} params {threads} threads", row)
                del tensors
    return throughput


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1M,16M", help="parameter counts, e.g. 1M,16M,64M")
    parser.add_argument(
        "--quick", action="store_true", help="1M parameters, 3 repeats, one thread, 60 steps"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--zstd-levels", default="1", help="zstd levels to run, e.g. 1,3")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="encode_stream workers (default: as many as torch threads in each setting)",
    )
    parser.add_argument(
        "--zstd-threads",
        type=int,
        default=0,
        help="encode_stream zstd_threads (0: zstd in the encoding thread)",
    )
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=RESULTS / "codec.json")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    repeats, steps = args.repeats, args.train_steps
    all_threads = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    thread_counts = sorted({1, all_threads})
    if args.quick:
        sizes, repeats, steps, thread_counts = [1 << 20], 3, 60, [1]
    levels = [int(level) for level in args.zstd_levels.split(",")]
    machine = describe_machine()

    throughput = measure_throughput(sizes, levels, thread_counts, args, repeats)
    torch.set_num_threads(all_threads)
    cuda = measure_cuda(max(sizes), args.block_size, repeats) if torch.cuda.is_available() else []

    compression: list[dict[str, Any]] = []
    delta, training = trained_delta(steps)
    datasets = {name: make(min(sizes)) for name, make in DATASETS.items()}
    datasets["trained transformer delta"] = delta
    for level in levels:
        for data_name, tensors in datasets.items():
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
            "zstd_threads": args.zstd_threads,
            "quick": args.quick,
            "statistic": "median of repeats; gbps_cpu = fp32 bytes / process CPU seconds",
        },
        "training": training,
        "throughput": throughput,
        "cuda": cuda,
        "compression": compression,
        "targets": targets(throughput),
    }
    write_json(args.out, results)
    print(markdown(results))
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0 if all(math.isfinite(row["ratio"]) for row in throughput) else 1


if __name__ == "__main__":
    sys.exit(main())
