"""``geofed demo``: a whole federation on one machine, from one command.

An embedded MQTT broker in this process, an ephemeral federation PKI in the work dir, the
coordinator and one regional agent per region as separate processes on loopback (each
agent with its own local worker group), the example task and the example region policies.
The data plane is real HTTPS with client certificates; only the broker is plain text on
loopback. Progress is read the way an operator reads it: the job status and ``/metrics``
of the coordinator, over mTLS.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from geofed.api_paths import ApiPaths
from geofed.control.broker import EmbeddedBroker, quiet_broker_logging
from geofed.fsutil import atomic_write_bytes
from geofed.pki import client_ssl_context, load_trust_bundle
from geofed_cli.demo.configs import DEMO_REGIONS, find_examples, write_demo_configs
from geofed_cli.demo.federation import create_demo_federation
from geofed_cli.demo.metrics_text import wan_bytes
from geofed_cli.demo.placement import place, visible_devices
from geofed_cli.demo.processes import ChildSet

log = logging.getLogger(__name__)

FEDERATION = "demo"
_TERMINAL = {"completed", "failed", "cancelled"}
_FINAL_EVALUATION_GRACE_S = 120.0


class DemoFailed(RuntimeError):
    """The demo could not run to the end; the message says where it stopped."""


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """What ``geofed demo`` was asked to do."""

    workdir: Path
    rounds: int = 10
    regions: int = 3
    inner_steps: int = 30
    examples: Path | None = None
    timeout_s: float = 900.0
    startup_timeout_s: float = 180.0


@dataclass
class DemoRound:
    """What the progress view printed for one published round."""

    round: int
    val_loss: float | None
    elapsed_s: float
    wan_bytes_up: int
    wan_bytes_down: int
    fp32_bytes_equivalent: int


@dataclass
class DemoSummary:
    """The contents of ``summary.json``."""

    rounds_completed: int
    initial_loss: float | None
    final_loss: float | None
    wan_bytes_up: int
    wan_bytes_down: int
    fp32_bytes_equivalent: int
    regions: list[str]
    job: str
    job_state: str
    wall_seconds: float
    rounds: list[DemoRound] = field(default_factory=list)

    @property
    def compression_ratio(self) -> float | None:
        sent = self.wan_bytes_up + self.wan_bytes_down
        return self.fp32_bytes_equivalent / sent if sent else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def run_demo(options: DemoOptions, *, echo: Callable[[str], None] = print) -> DemoSummary:
    """Run the demo to the end of its job and return (and write) its summary."""
    if not 1 <= options.regions <= len(DEMO_REGIONS):
        raise DemoFailed(
            f"--regions must be between 1 and {len(DEMO_REGIONS)}: the example policies "
            f"describe {', '.join(DEMO_REGIONS)}"
        )
    if options.rounds < 1:
        raise DemoFailed("--rounds must be at least 1")
    regions = list(DEMO_REGIONS[: options.regions])
    work = options.workdir.resolve()
    if work.exists() and any(work.iterdir()):
        raise DemoFailed(f"work dir {work} is not empty: pass a new --workdir or remove it")
    work.mkdir(parents=True, exist_ok=True)
    examples = find_examples(options.examples)
    started = time.monotonic()

    echo(f"geofed demo: {len(regions)} regions ({', '.join(regions)}), {options.rounds} rounds")
    echo(f"  work dir  {work}")
    # Key generation and fsyncs: off the event loop, which already runs the broker.
    federation = await asyncio.to_thread(create_demo_federation, work / "pki", FEDERATION, regions)
    echo(f"  PKI       federation {FEDERATION!r}: a CA and {len(regions) + 2} certificates")

    quiet_broker_logging()
    async with EmbeddedBroker(port=0) as broker:
        echo(f"  MQTT      embedded broker on 127.0.0.1:{broker.port} (plain text, loopback only)")
        http_port = _free_port()
        placement = place(await asyncio.to_thread(visible_devices), regions)
        configs = await asyncio.to_thread(
            write_demo_configs,
            examples=examples,
            work=work,
            federation=federation,
            regions=regions,
            http_port=http_port,
            mqtt_port=broker.port,
            rounds=options.rounds,
            inner_steps=options.inner_steps,
            placement=placement,
        )
        ssl_context = client_ssl_context(
            load_trust_bundle(federation.trust_bundle),
            federation.operator.cert,
            federation.operator.key,
        )
        base = f"https://localhost:{http_port}"
        timeout = aiohttp.ClientTimeout(total=30)
        async with (
            ChildSet(work / "logs") as children,
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ssl_context), timeout=timeout
            ) as http,
        ):
            await children.start(
                "coordinator", ["coordinator", "--config", str(configs.coordinator)]
            )
            await _wait_ready(http, base, children, options.startup_timeout_s)
            echo(f"  HTTPS     coordinator on {base} (mTLS)")
            for region in regions:
                await children.start(
                    f"agent-{region}", ["agent", "--config", str(configs.agents[region])]
                )
            echo(f"  placement {placement.describe()}")
            echo(f"  agents    {placement.agents_line()}")
            await _submit(http, base, configs.job)
            echo(f"  job       {configs.job_id!r} admitted by every region's policy")
            echo("")
            summary = await _follow(
                http, base, configs.job_id, regions, children, options, started, echo
            )
            echo("")
            echo("stopping the federation ...")
    await asyncio.to_thread(_write_summary, work / "summary.json", summary)
    _print_summary(summary, work, echo)
    if summary.job_state != "completed":
        raise DemoFailed(f"job ended {summary.job_state!r}; logs are in {work / 'logs'}")
    return summary


async def _wait_ready(
    http: aiohttp.ClientSession, base: str, children: ChildSet, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        children.check_alive()
        try:
            async with http.get(f"{base}/readyz") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)
    raise DemoFailed(f"the coordinator was not ready within {timeout_s:.0f} s")


async def _submit(http: aiohttp.ClientSession, base: str, job_file: Path) -> None:
    body = await asyncio.to_thread(job_file.read_bytes)
    headers = {"Content-Type": "application/yaml"}
    async with http.post(base + ApiPaths.JOBS, data=body, headers=headers) as response:
        if response.status != 201:
            raise DemoFailed(f"job refused ({response.status}): {await response.text()}")


async def _get_json(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url) as response:
        response.raise_for_status()
        data: dict[str, Any] = await response.json()
        return data


async def _scrape(http: aiohttp.ClientSession, base: str) -> tuple[int, int, int]:
    async with http.get(f"{base}/metrics") as response:
        response.raise_for_status()
        return wan_bytes(await response.text())


async def _follow(
    http: aiohttp.ClientSession,
    base: str,
    job: str,
    regions: list[str],
    children: ChildSet,
    options: DemoOptions,
    started: float,
    echo: Callable[[str], None],
) -> DemoSummary:
    deadline = time.monotonic() + options.timeout_s
    records: list[DemoRound] = []
    initial: float | None = None
    seen_val_round = -1
    status: dict[str, Any] = {}
    finished_at: float | None = None
    state = "running"
    echo(
        f"{'round':>5}  {'global val loss':>15}  {'WAN up':>9}  {'WAN down':>9}  "
        f"{'vs fp32':>7}  {'elapsed':>7}"
    )
    while True:
        if time.monotonic() > deadline:
            raise DemoFailed(f"the job did not finish within {options.timeout_s:.0f} s")
        children.check_alive()
        try:
            status = await _get_json(http, base + ApiPaths.job(job))
            up, down, fp32 = await _scrape(http, base)
        except aiohttp.ClientError as err:
            log.debug("polling the coordinator failed: %s", err)
            await asyncio.sleep(1.0)
            continue
        state = str(status.get("state", "unknown"))
        for entry in status.get("val_loss_history", []):
            number, value = int(entry["round"]), float(entry["value"])
            if number <= seen_val_round:
                continue
            seen_val_round = number
            elapsed = time.monotonic() - started
            if number == 0:
                initial = value
                echo(
                    f"{0:>5}  {value:>15.4f}  {'':>9}  {'':>9}  {'':>7}  {elapsed:>6.0f}s"
                    "   (initial parameters)"
                )
                continue
            ratio = f"{fp32 / (up + down):.1f}x" if up + down else "-"
            echo(
                f"{number:>5}  {value:>15.4f}  {_mb(up):>9}  {_mb(down):>9}  "
                f"{ratio:>7}  {elapsed:>6.0f}s"
            )
            records.append(DemoRound(number, value, elapsed, up, down, fp32))
        if state in _TERMINAL:
            if state != "completed" or seen_val_round >= options.rounds:
                break
            # Completed: the coordinator finishes evaluating the last parameters first.
            finished_at = finished_at or time.monotonic()
            if time.monotonic() - finished_at > _FINAL_EVALUATION_GRACE_S:
                break
        await asyncio.sleep(1.0)
    up, down, fp32 = await _scrape(http, base)
    return DemoSummary(
        rounds_completed=int(status.get("round", len(records))),
        initial_loss=initial,
        final_loss=records[-1].val_loss if records else initial,
        wan_bytes_up=up,
        wan_bytes_down=down,
        fp32_bytes_equivalent=fp32,
        regions=regions,
        job=job,
        job_state=state,
        wall_seconds=time.monotonic() - started,
        rounds=records,
    )


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _write_summary(path: Path, summary: DemoSummary) -> None:
    body = asdict(summary)
    body["compression_ratio"] = summary.compression_ratio
    atomic_write_bytes(path, (json.dumps(body, indent=2) + "\n").encode())


def _print_summary(summary: DemoSummary, work: Path, echo: Callable[[str], None]) -> None:
    echo(
        f"job {summary.job!r}: {summary.job_state}, {summary.rounds_completed} rounds "
        f"in {summary.wall_seconds:.0f} s"
    )
    if summary.initial_loss is not None and summary.final_loss is not None:
        echo(f"  global validation loss {summary.initial_loss:.4f} -> {summary.final_loss:.4f}")
    ratio = summary.compression_ratio
    echo(
        f"  WAN bytes: {_mb(summary.wan_bytes_up)} up, {_mb(summary.wan_bytes_down)} down; "
        f"fp32 would be {_mb(summary.fp32_bytes_equivalent)}"
        + (f" ({ratio:.1f}x less sent)" if ratio else "")
    )
    echo(f"  summary: {work / 'summary.json'}   logs: {work / 'logs'}")
