"""Delta upload and snapshot download throughput through a real coordinator, over TLS.

    python -m benchmarks.transfer [--mb 16] [--windows 1,8] [--rtt-ms 80]
        [--bandwidth-mbps 0] [--repeats 2] [--smoke] [--out PATH] [--note TEXT]

A coordinator daemon runs as its own process (``geofed coordinator``, mutual TLS, SQLite,
the embedded MQTT broker) on a throwaway PKI and the example configs. For each trial a
fresh job of the example charlm task, sized so that its int8 delta is about ``--mb`` MB,
is submitted; the region eu-west's agent code then uploads one delta for its round 0
with :class:`regional_agent.transfer.uploader.Uploader` (manifest, every chunk, commit; each chunk
answered only once durable) over a fresh client session built as the agent builds it
(:func:`regional_agent.transfer.coordinator_client.build_session`), and the job is cancelled.

Two links: ``loopback`` (straight to the coordinator's port) and ``wan`` (through the
userspace WAN emulator, :mod:`geofed.wanemu`, with ``--rtt-ms`` round-trip time split
evenly over both directions and an optional bandwidth cap per connection direction). Each
``--windows`` value is the number of chunk PUTs in flight (``transfer.upload_window``;
1 is the serial baseline); trials are interleaved (repeat, link, window) so that drift in
the machine's load spreads over every configuration. Each first trial of a repeat and link
also times the download of θ_0's snapshot (one streamed GET,
:meth:`regional_agent.transfer.coordinator_client.CoordinatorClient.download`).

Reported: MB/s (10^6 bytes of encoded delta per second, manifest to commit answer) per
trial, and the median per (link, window) with its ratio to window 1. The coordinator,
the emulator and the client share this machine's cores; on a shared machine the figures
move with the load (the report records the load average).

Writes ``benchmarks/results/transfer.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import torch
import yaml

from benchmarks._machine import describe_machine, machine_line
from benchmarks._report import publish
from benchmarks.round_overhead import charlm_config
from geofed.artifact_check import snapshot_params
from geofed.codec import ErrorFeedback
from geofed.codec_params import CodecParams
from geofed.control.broker import EmbeddedBroker
from geofed.pki import client_ssl_context, load_trust_bundle
from geofed.ports import unused_port
from geofed.types import ArtifactKind
from geofed.wanemu import LinkSettings, WanProxy
from geofed_cli.demo.configs import find_examples, write_demo_configs
from geofed_cli.demo.federation import create_demo_federation
from geofed_cli.demo.processes import ChildSet
from regional_agent.config import AgentConfig, load_config
from regional_agent.credentials import Credentials, load_credentials
from regional_agent.rounds.delta import (
    DeltaOrigin,
    EncodedDelta,
    delta_manifest,
    encode_delta,
    sign_delta,
)
from regional_agent.state import DeltaMeta, JobDirectory, SpooledDelta
from regional_agent.transfer.coordinator_client import CoordinatorClient, build_session
from regional_agent.transfer.sync import verify_artifact
from regional_agent.transfer.uploader import Uploader

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "transfer.json"
FEDERATION = "bench"
REGION = "eu-west"
REGIONS = ("eu-west", "us-east")
READY_S = 120.0
#: A round deadline no trial reaches (each job is cancelled after its trial).
DEADLINE_S = 3600


@dataclass(frozen=True)
class Settings:
    mb: float
    windows: tuple[int, ...]
    rtt_ms: float
    bandwidth_mbps: float
    repeats: int
    smoke: bool
    out: Path
    note: str


@dataclass
class Federation:
    """The running coordinator and what the trials need to talk to it."""

    base_url: str
    port: int
    operator: aiohttp.ClientSession
    agent: AgentConfig
    credentials: Credentials
    job: dict[str, Any]
    children: ChildSet
    spool_root: Path


def task_options(mb: float) -> dict[str, int]:
    """charlm options whose int8 delta is about ``mb`` MB (one byte per parameter)."""
    config = charlm_config(int(mb * 1e6))
    return {
        "d_model": config["d_model"],
        "n_layers": config["n_layers"],
        "n_heads": config["n_heads"],
        "d_ff": config["d_ff"],
    }


async def _json(
    session: aiohttp.ClientSession, method: str, url: str, **kwargs: Any
) -> tuple[int, Any]:
    async with session.request(method, url, **kwargs) as response:
        return response.status, await response.json(content_type=None)


async def _wait_ready(fed: Federation) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        fed.children.check_alive()
        try:
            async with fed.operator.get(f"{fed.base_url}/readyz") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"coordinator not ready within {READY_S} s")


async def _open_job(fed: Federation, name: str) -> dict[str, Any]:
    """Submit a copy of the job named ``name``; its status once round 0 collects deltas."""
    spec = {**fed.job, "job": name}
    status, body = await _json(
        fed.operator,
        "POST",
        f"{fed.base_url}/v1/jobs",
        data=yaml.safe_dump(spec).encode(),
        headers={"Content-Type": "application/yaml"},
    )
    if status != 201:
        raise RuntimeError(f"job {name} refused: {status} {body}")
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        status, job = await _json(fed.operator, "GET", f"{fed.base_url}/v1/jobs/{name}")
        current = job.get("current") if isinstance(job, dict) else None
        if isinstance(current, dict) and current.get("phase") == "collecting":
            return dict(job)
        await asyncio.sleep(0.1)
    raise RuntimeError(f"job {name} did not open round 0: {job}")


async def _cancel(fed: Federation, name: str) -> None:
    await _json(fed.operator, "POST", f"{fed.base_url}/v1/jobs/{name}/cancel")


def _client(fed: Federation, session: aiohttp.ClientSession, url: str) -> CoordinatorClient:
    return CoordinatorClient(session, url, fed.agent.timeouts)


async def download_snapshot(
    fed: Federation, url: str, job: str
) -> tuple[dict[str, torch.Tensor], str, dict[str, Any]]:
    """θ_0 of ``job`` as a region fetches it (timed), verified; its hash and the timing."""
    async with build_session(fed.agent, fed.credentials) as session:
        client = _client(fed, session, url)
        status = (await client.request("GET", f"/v1/jobs/{job}/checkpoints/latest")).json()
        started = time.perf_counter()
        data = await client.download(status["snapshot"]["url"], what="snapshot")
        seconds = time.perf_counter() - started
    snapshot = await asyncio.to_thread(
        verify_artifact,
        data,
        fed.credentials.bundle,
        kind=ArtifactKind.GLOBAL_CHECKPOINT,
        job=job,
        round_=0,
        now=datetime.now(UTC),
    )
    params, params_hash = snapshot_params(snapshot)
    timing = {"bytes": len(data), "seconds": seconds, "mb_per_s": len(data) / 1e6 / seconds}
    return params, params_hash, timing


@dataclass
class Delta:
    """One encoded delta, signed again for each trial's job."""

    encoded: EncodedDelta
    codec: CodecParams


def encode(params: dict[str, torch.Tensor], codec: CodecParams) -> Delta:
    generator = torch.Generator().manual_seed(0)
    local = {n: t - 0.01 * torch.randn(t.shape, generator=generator) for n, t in params.items()}
    return Delta(encode_delta(params, local, ErrorFeedback(), codec), codec)


def spool(fed: Federation, delta: Delta, job: str, base_hash: str, root: Path) -> SpooledDelta:
    origin = DeltaOrigin(
        job=job,
        round=0,
        base_round=0,
        base_hash=base_hash,
        tokens=1000,
        producer=fed.credentials.identity,
        jurisdiction="EU",
        datasets=tuple(fed.job["regions"][REGION]),
    )
    manifest = delta_manifest(origin, delta.encoded.stream, now=datetime.now(UTC))
    signed = sign_delta(manifest, fed.credentials)
    meta = DeltaMeta(train_loss=1.0, tokens=1000, params_hash=base_hash)
    return JobDirectory(root, job).write_spool(
        0, signed.to_bytes(), delta.encoded.frames, ErrorFeedback(), meta
    )


async def upload(fed: Federation, url: str, job: str, spooled: SpooledDelta, window: int) -> float:
    async with build_session(fed.agent, fed.credentials) as session:
        uploader = Uploader(_client(fed, session, url), REGION, window=window)
        started = time.perf_counter()
        report = await uploader.upload(job, spooled, {"train_loss": 1.0})
        seconds = time.perf_counter() - started
    if report.already_accepted or report.chunks_sent != spooled.frame_count:
        raise RuntimeError(f"upload of {job} sent {report.chunks_sent} chunks: {report}")
    return seconds


def _link(settings: Settings) -> LinkSettings:
    bandwidth = settings.bandwidth_mbps * 1e6 / 8 if settings.bandwidth_mbps else None
    return LinkSettings(latency_s=settings.rtt_ms / 2000, bandwidth_bps=bandwidth)


async def run(settings: Settings) -> dict[str, Any]:
    machine = describe_machine()
    with tempfile.TemporaryDirectory(prefix="geofed-transfer-") as tmp:
        work = Path(tmp)
        federation = await asyncio.to_thread(
            create_demo_federation, work / "pki", FEDERATION, REGIONS
        )
        port = unused_port()
        async with EmbeddedBroker(port=0) as broker:

            def customize(name: str, data: dict[str, Any]) -> None:
                if name == "job":
                    data["deadline"] = {
                        "initial_s": DEADLINE_S,
                        "min_s": DEADLINE_S,
                        "max_s": DEADLINE_S,
                    }
                    data.pop("evaluation", None)

            configs = await asyncio.to_thread(
                write_demo_configs,
                examples=find_examples(),
                work=work,
                federation=federation,
                regions=REGIONS,
                http_port=port,
                mqtt_port=broker.port,
                rounds=1,
                inner_steps=1,
                task_options=task_options(settings.mb),
                customize=customize,
            )
            job = yaml.safe_load(configs.job.read_text())
            agent = load_config(configs.agents[REGION])
            credentials = load_credentials(agent.identity, agent.identity_uri)
            ssl = client_ssl_context(
                load_trust_bundle(federation.trust_bundle),
                federation.operator.cert,
                federation.operator.key,
            )
            async with (
                ChildSet(work / "logs") as children,
                aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(ssl=ssl),
                    timeout=aiohttp.ClientTimeout(total=120),
                ) as operator,
            ):
                children.env = {**os.environ, "PYTHONPATH": str(REPO)}
                await children.start(
                    "coordinator", ["coordinator", "--config", str(configs.coordinator)]
                )
                fed = Federation(
                    f"https://localhost:{port}",
                    port,
                    operator,
                    agent,
                    credentials,
                    job,
                    children,
                    work / "agent",
                )
                await _wait_ready(fed)
                async with WanProxy(
                    "127.0.0.1",
                    0,
                    "127.0.0.1",
                    port,
                    seed=1,
                    upstream=_link(settings),
                    downstream=_link(settings),
                ) as wan:
                    links = {
                        "loopback": fed.base_url,
                        "wan": f"https://localhost:{wan.port}",
                    }
                    trials, downloads, delta_bytes, chunks = await _trials(fed, settings, links)
    return {
        "benchmark": "transfer",
        "settings": {
            "mb": settings.mb,
            "windows": list(settings.windows),
            "rtt_ms": settings.rtt_ms,
            "bandwidth_mbps": settings.bandwidth_mbps or None,
            "repeats": settings.repeats,
            "smoke": settings.smoke,
            "note": settings.note,
        },
        "delta_bytes": delta_bytes,
        "chunks": chunks,
        "machine": machine,
        "trials": trials,
        "downloads": downloads,
        "summary": summarise(trials, settings.windows),
    }


async def _trials(
    fed: Federation, settings: Settings, links: dict[str, str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int, int]:
    trials: list[dict[str, Any]] = []
    downloads: list[dict[str, Any]] = []
    delta: Delta | None = None
    count = 0
    delta_bytes = chunks = 0
    for repeat in range(settings.repeats):
        for link, url in links.items():
            for position, window in enumerate(settings.windows):
                count += 1
                name = f"transfer-{count}"
                job = await _open_job(fed, name)
                if delta is None or position == 0:
                    params, base_hash, timing = await download_snapshot(fed, url, name)
                    if job["params_hash"] != base_hash:
                        raise RuntimeError("the downloaded θ_0 is not the job's")
                    downloads.append({"link": link, "repeat": repeat, **timing})
                    print(f"download {link}: {timing['mb_per_s']:.1f} MB/s", file=sys.stderr)
                    if delta is None:
                        codec = CodecParams(**fed.job["codec"])
                        delta = await asyncio.to_thread(encode, params, codec)
                spooled = await asyncio.to_thread(
                    spool, fed, delta, name, job["params_hash"], fed.spool_root
                )
                size = await asyncio.to_thread(_stream_bytes, spooled)
                delta_bytes, chunks = size, spooled.frame_count
                seconds = await upload(fed, url, name, spooled, window)
                await _cancel(fed, name)
                row = {
                    "link": link,
                    "window": window,
                    "repeat": repeat,
                    "seconds": seconds,
                    "mb_per_s": size / 1e6 / seconds,
                }
                trials.append(row)
                print(
                    f"upload {link} window {window}: {row['mb_per_s']:.1f} MB/s ({seconds:.2f} s)",
                    file=sys.stderr,
                )
    return trials, downloads, delta_bytes, chunks


def _stream_bytes(spooled: SpooledDelta) -> int:
    return sum(len(spooled.read_frame(i)) for i in range(spooled.frame_count))


def summarise(trials: list[dict[str, Any]], windows: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    for link in dict.fromkeys(t["link"] for t in trials):
        base = None
        for window in windows:
            rates = [t["mb_per_s"] for t in trials if (t["link"], t["window"]) == (link, window)]
            median = statistics.median(rates)
            if window == windows[0]:
                base = median
            rows.append(
                {
                    "link": link,
                    "window": window,
                    "trials": len(rates),
                    "median_mb_per_s": median,
                    "min_mb_per_s": min(rates),
                    "max_mb_per_s": max(rates),
                    "ratio_to_first_window": median / base if base else None,
                }
            )
    return rows


def render(report: dict[str, Any]) -> str:
    s = report["settings"]
    wan = f"{s['rtt_ms']:g} ms RTT" + (
        f", {s['bandwidth_mbps']:g} Mbit/s per direction" if s["bandwidth_mbps"] else ""
    )
    lines = [
        "# Delta upload and snapshot download throughput",
        "",
        f"Machine: {machine_line(report['machine'])}",
        "",
        f"One delta of {report['delta_bytes'] / 1e6:.1f} MB in {report['chunks']} chunks "
        f"(int8), uploaded by the agent's uploader to a coordinator process over mutual TLS; "
        f"`wan` goes through the WAN emulator ({wan}). {s['repeats']} repeat(s)"
        + (", smoke run" if s["smoke"] else "")
        + (f". Note: {s['note']}" if s["note"] else "")
        + ".",
        "",
        f"| link | window | trials | median MB/s | min-max | x window {s['windows'][0]} |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["summary"]:
        ratio = row["ratio_to_first_window"]
        lines.append(
            f"| {row['link']} | {row['window']} | {row['trials']} | "
            f"{row['median_mb_per_s']:.1f} | {row['min_mb_per_s']:.1f}-"
            f"{row['max_mb_per_s']:.1f} | {ratio:.2f} |"
        )
    lines += ["", "| download (θ_0 snapshot, one GET) | MB | MB/s |", "|---|---|---|"]
    for row in report["downloads"]:
        lines.append(f"| {row['link']} | {row['bytes'] / 1e6:.1f} | {row['mb_per_s']:.1f} |")
    lines += [
        "",
        "The coordinator, the WAN emulator and the uploader share the machine's cores; on a "
        "shared machine these figures move with its load.",
        "",
    ]
    return "\n".join(lines)


def _windows(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"windows must be integers, got {text!r}") from None
    if not values or any(not 1 <= v <= 32 for v in values):
        raise argparse.ArgumentTypeError(f"each window must be in 1..32, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=float, default=16.0, help="delta size in MB (default 16)")
    parser.add_argument("--windows", type=_windows, default=(1, 8), help="e.g. 1,4,8")
    parser.add_argument("--rtt-ms", type=float, default=80.0, help="WAN round trip (80)")
    parser.add_argument(
        "--bandwidth-mbps", type=float, default=0.0, help="WAN cap per direction (0: none)"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a 2 MB delta, one repeat")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    if args.mb <= 0 or args.repeats < 1 or args.rtt_ms < 0 or args.bandwidth_mbps < 0:
        parser.error("--mb, --repeats must be positive; --rtt-ms, --bandwidth-mbps >= 0")
    mb, repeats = (2.0, 1) if args.smoke else (args.mb, args.repeats)
    return Settings(
        mb, args.windows, args.rtt_ms, args.bandwidth_mbps, repeats, args.smoke, args.out, args.note
    )


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    report = asyncio.run(run(settings))
    publish(report, settings.out, render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
