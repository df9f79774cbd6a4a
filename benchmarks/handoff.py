"""The round's hand-off from the workers to the agent: parameters against the quantized delta.

    python -m benchmarks.handoff [--params 25e6] [--repeats 3] [--scheme int8]
        [--device cpu|cuda] [--smoke] [--out PATH] [--note TEXT]

What lies between a region's last inner step and the moment its delta can leave, both
ways, with the project's own functions on real files (fsync'd) in a temporary directory:

- ``params`` (the baseline, a result without a
  :class:`~regional_agent.handoff.messages.DeltaRequest`):
  rank 0 copies the trained state to fp32 host tensors (``ParallelModel.full_state``) and
  writes the result; the agent reads it, loads its residual, forms Δ, quantizes it with
  error feedback on the CPU and frames it (``encode_delta``), signs the manifest and
  spools delta and residual (``JobDirectory.write_spool``).
- ``delta`` (what the agent asks for): rank 0 quantizes Δ where the parameters are, with
  the residual it kept (``quantize_round_delta``: θ_r read from its file, the residual
  written for the agent), and seals it into the round's stream file (codes and scales,
  framed; ``write_delta_stream``) with the result; the agent reads the result, checks the
  stream against θ (``check_worker_delta``), signs it (hashing the frames) and spools it,
  linking the stream and the residual.

Each repeat runs a round of both ways, in turn, on the same θ_r and trained state (a
charlm layout of at least ``--params`` parameters; Δ ~ N(0, 1e-3²)), the second and later
rounds with the residual of the one before. Seconds are medians over the repeats; the
ratio is params / delta. The first round of each way is left out of the medians when
there are more (it finds no residual). Signing and the manifest cost the same both ways.

Writes ``benchmarks/results/handoff.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from benchmarks._machine import describe_machine, machine_line
from benchmarks._report import publish
from benchmarks.round_overhead import charlm_config, charlm_shapes, model_size, random_state
from geofed.codec import EncodedStream, ErrorFeedback
from geofed.codec_params import SCHEMES, CodecParams
from geofed.manifest import sign_manifest
from geofed.params import parameters_vector_hash, state_to_fp32
from geofed.pki.authority import IssuedCredential, create_ca, issue
from geofed.types import Identity, Role
from regional_agent.handoff.delta_stream import DeltaStream
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.messages import DeltaRequest, RoundSummary
from regional_agent.rounds.delta import (
    DeltaOrigin,
    check_worker_delta,
    delta_manifest,
    encode_delta,
)
from regional_agent.state import DeltaMeta, JobDirectory
from regional_agent.worker.device_delta import payloads_hash, quantize_round_delta
from regional_agent.worker.residual_shards import DeviceResidual

DEFAULT_OUT = Path(__file__).parent / "results" / "handoff.json"
JOB = "bench"
REGION = "eu-west"


@dataclass(frozen=True)
class Settings:
    params: int
    repeats: int
    scheme: str
    device: str
    out: Path
    note: str


@dataclass
class Bench:
    """One temporary region: hand-off and state directories, θ_r, the trained state."""

    handoff: HandoffDir
    job: JobDirectory
    base_path: Path
    base: dict[str, torch.Tensor]
    trained: dict[str, torch.Tensor]  # on the device, as rank 0's replica holds it
    codec: CodecParams
    signer: IssuedCredential
    kept: DeviceResidual | None = None

    def summary(self, round_: int, params_hash: str) -> RoundSummary:
        return RoundSummary(
            job=JOB,
            round=round_,
            steps=1,
            tokens=1,
            mean_loss=1.0,
            cursor=round_ + 1,
            base_params_hash="b" * 64,
            params_hash=params_hash,
            world_size=1,
            train_seconds=0.0,
        )

    def spool(
        self, round_: int, stream: EncodedStream | DeltaStream, residual: ErrorFeedback | Path
    ) -> None:
        """Sign and spool the delta as the agent does, then accept it (the residual moves)."""
        origin = DeltaOrigin(
            job=JOB,
            round=round_,
            base_round=round_,
            base_hash="b" * 64,
            tokens=1,
            producer=self.signer.identity,
            jurisdiction="EU",
            datasets=("bench",),
        )
        manifest = delta_manifest(origin, stream, now=datetime.now(UTC))
        signed = sign_manifest(manifest, self.signer.private_key, self.signer.certificate)
        meta = DeltaMeta(train_loss=1.0, tokens=1, params_hash="b" * 64)
        frames = stream.path if isinstance(stream, DeltaStream) else list(stream.frames())
        self.job.write_spool(round_, signed.to_bytes(), frames, residual, meta)


def timed(phases: dict[str, float], name: str, work: Callable[[], Any]) -> Any:
    started = time.perf_counter()
    value = work()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    phases[name] = time.perf_counter() - started
    return value


def params_round(bench: Bench, round_: int) -> dict[str, float]:
    """The baseline: the trained parameters through the file, encoded by the agent."""
    phases: dict[str, float] = {}
    params = timed(phases, "worker: copy to host", lambda: state_to_fp32(bench.trained))
    summary = bench.summary(
        round_, timed(phases, "worker: hash", lambda: parameters_vector_hash(params))
    )

    def write() -> None:
        bench.handoff.write_result(summary, params)
        bench.handoff.write_done(summary)

    timed(phases, "worker: write result", write)
    result = timed(phases, "agent: read result", lambda: bench.handoff.read_completed(JOB, round_))
    feedback = timed(phases, "agent: load residual", bench.job.load_feedback)
    encoded = timed(
        phases,
        "agent: encode",
        lambda: encode_delta(bench.base, result.params, feedback, bench.codec),
    )
    timed(
        phases, "agent: sign + spool", lambda: bench.spool(round_, encoded.stream, encoded.feedback)
    )
    bench.job.promote(round_)
    return phases


def delta_round(bench: Bench, round_: int) -> dict[str, float]:
    """The delta quantized and sealed by rank 0 where the parameters are, spooled by the
    agent as it is."""
    phases: dict[str, float] = {}
    request = DeltaRequest(bench.codec, str(bench.job.feedback_path))

    def quantize() -> Any:
        quantized, bench.kept = quantize_round_delta(
            request,
            job=JOB,
            round_=round_,
            region=REGION,
            base_path=str(bench.base_path),
            local=bench.trained,
            residual_path=bench.handoff.residual_path(JOB, round_),
            kept=bench.kept,
        )
        return quantized

    quantized = timed(phases, "worker: quantize + residual", quantize)
    summary = bench.summary(round_, timed(phases, "worker: hash", lambda: payloads_hash(quantized)))

    def write() -> None:
        bench.handoff.write_result(summary, delta=quantized)
        bench.handoff.write_done(summary)

    timed(phases, "worker: seal + write result", write)
    result = timed(phases, "agent: read result", lambda: bench.handoff.read_completed(JOB, round_))
    stream = timed(
        phases, "agent: check", lambda: check_worker_delta(bench.base, result.delta, bench.codec)
    )
    timed(phases, "agent: sign + spool", lambda: bench.spool(round_, stream, result.residual))
    bench.job.promote(round_)
    return phases


def make_bench(root: Path, settings: Settings, name: str, signer: IssuedCredential) -> Bench:
    shapes = charlm_shapes(charlm_config(settings.params))
    base = random_state(shapes, 1, 0.02)
    trained = {
        key: (tensor - torch.randn(tensor.shape, generator=torch.Generator().manual_seed(2)) * 1e-3)
        for key, tensor in base.items()
    }
    directory = root / name
    base_path = directory / "theta.pt"
    directory.mkdir()
    torch.save(base, base_path)
    return Bench(
        handoff=HandoffDir(directory / "workers"),
        job=JobDirectory(directory / "state", JOB),
        base_path=base_path,
        base=base,
        trained={k: v.to(settings.device) for k, v in trained.items()},
        codec=CodecParams(scheme=settings.scheme),  # type: ignore[arg-type]
        signer=signer,
    )


def run(settings: Settings) -> dict[str, Any]:
    ca = create_ca("bench")
    signer = issue(ca, Identity("bench", Role.REGION, REGION))
    ways: dict[str, Callable[[Bench, int], dict[str, float]]] = {
        "params": params_round,
        "delta": delta_round,
    }
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory(prefix="geofed-handoff-") as tmp:
        benches = {way: make_bench(Path(tmp), settings, way, signer) for way in ways}
        for bench in benches.values():
            bench.job.root.mkdir(parents=True)
        count = sum(t.numel() for t in benches["params"].base.values())
        for round_ in range(settings.repeats + (1 if settings.repeats > 1 else 0)):
            for way, work in ways.items():
                phases = work(benches[way], round_)
                phases["total"] = sum(phases.values())
                print(f"round {round_} {way}: {phases['total']:.3f} s", file=sys.stderr)
                runs[way].append(phases)
    kept = {way: rows[1:] if len(rows) > 1 else rows for way, rows in runs.items()}
    medians = {
        way: {phase: statistics.median(r[phase] for r in rows) for phase in rows[0]}
        for way, rows in kept.items()
    }
    return {
        "benchmark": "handoff",
        "machine": describe_machine(),
        "settings": {
            "params": count,
            "repeats": settings.repeats,
            "scheme": settings.scheme,
            "device": settings.device,
            "note": settings.note,
        },
        "medians_s": medians,
        "ratio_total": medians["params"]["total"] / medians["delta"]["total"],
        "runs": runs,
    }


def render(report: dict[str, Any]) -> str:
    settings = report["settings"]
    medians = report["medians_s"]
    lines = [
        "# Hand-off from the workers to the agent",
        "",
        f"Machine: {machine_line(report['machine'])}.",
        "",
        f"charlm layout, {settings['params']:,} parameters, {settings['scheme']}, trained state "
        f"on `{settings['device']}`; medians of {settings['repeats']} round(s), each with the "
        "residual of the round before. `params`: the trained parameters through the result "
        "file, encoded by the agent (the baseline); `delta`: quantized by rank 0 where the "
        "parameters are and sealed into a stream file that the agent spools as it is. Files are "
        "fsync'd.",
    ]
    if settings["note"]:
        lines += ["", settings["note"]]
    for way in ("params", "delta"):
        lines += ["", f"## {way}", "", "| phase | s |", "|---|---|"]
        lines += [f"| {phase} | {seconds:.3f} |" for phase, seconds in medians[way].items()]
    lines += [
        "",
        f"Total: params {medians['params']['total']:.3f} s, delta "
        f"{medians['delta']['total']:.3f} s, params / delta = {report['ratio_total']:.2f}.",
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> Settings:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.handoff", description=__doc__)
    parser.add_argument("--params", type=model_size, help="model size, default 25e6; smoke 1e5")
    parser.add_argument("--repeats", type=int, help="rounds measured, default 3; smoke 1")
    parser.add_argument("--scheme", choices=[s for s in SCHEMES if s != "fp32"], default="int8")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="trained state"
    )
    parser.add_argument("--smoke", action="store_true", help="a run of a second or two")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON path")
    parser.add_argument("--note", default="", help="free text stored with the figures")
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.smoke else 3)
    if repeats < 1:
        parser.error("--repeats must be at least 1")
    return Settings(
        params=args.params or (100_000 if args.smoke else 25_000_000),
        repeats=repeats,
        scheme=args.scheme,
        device=args.device,
        out=args.out,
        note=args.note,
    )


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(list(sys.argv[1:] if argv is None else argv))
    print(f"machine: {machine_line(describe_machine())}", file=sys.stderr)
    report = run(settings)
    publish(report, settings.out, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
