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
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from geofed.api_paths import ApiPaths
from geofed.control.broker import quiet_broker_logging
from geofed.fsutil import atomic_write_bytes
from geofed.pki import client_ssl_context, load_trust_bundle
from geofed.ports import unused_port
from geofed.wanspec import WanLink
from geofed_cli.demo.browser import write_browser_credential
from geofed_cli.demo.chaos import BrokerHolder, ChaosMonkey, judge_chaos, plan_chaos
from geofed_cli.demo.configs import DEMO_REGIONS, DemoConfigs, find_examples, write_demo_configs
from geofed_cli.demo.federation import DemoFederation, create_demo_federation
from geofed_cli.demo.metrics_text import RestartSafeTotals, wan_bytes
from geofed_cli.demo.placement import Placement, PlacementRefused, place, visible_devices
from geofed_cli.demo.processes import ChildSet
from geofed_cli.demo.supervisor import RestartPolicy
from geofed_cli.demo.utilization import format_utilization, utilization_by_region
from geofed_cli.demo.wan import route_configs, wan_links

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
    #: Each region's emulated link to the coordinator; None: plain loopback.
    wan: WanLink | None = None
    #: The job's ``overlap`` mode; None: the job spec's default.
    overlap: str | None = None
    #: Overrides of the example task's options.
    task_options: dict[str, Any] | None = None
    #: Inject real faults while the job runs (:mod:`geofed_cli.demo.chaos`).
    chaos: bool = False
    #: Each region's gloo ranks on a machine without a GPU; None: the launcher's auto.
    workers: int | None = None


@dataclass
class DemoRound:
    """What the progress view printed for one published round."""

    round: int
    val_loss: float | None
    elapsed_s: float
    wan_bytes_up: int
    wan_bytes_down: int
    fp32_bytes_equivalent: int
    #: Region -> compute utilization over the rounds its agent had recorded by then.
    compute_utilization: dict[str, float | None] = field(default_factory=dict)


@dataclass
class DemoSummary:
    """The contents of ``summary.json``."""

    rounds_completed: int
    initial_loss: float | None
    final_loss: float | None
    wan_bytes_up: int
    wan_bytes_down: int
    fp32_bytes_equivalent: int
    #: Deltas the coordinator accepted over the run (its durable receipts).
    deltas_accepted: int
    regions: list[str]
    job: str
    job_state: str
    wall_seconds: float
    rounds: list[DemoRound] = field(default_factory=list)
    #: Region -> union of its workers' training intervals / their wall-clock span.
    compute_utilization: dict[str, float | None] = field(default_factory=dict)
    #: Daemon -> how many times the demo restarted it (as its systemd unit would).
    restarts: dict[str, int] = field(default_factory=dict)
    #: ``--chaos``: what was injected, what was lost, whether the regions agree.
    chaos: dict[str, Any] | None = None
    #: Every metric of the newest evaluated parameters (``{"round", "metrics"}``), as the
    #: job's status shows it.
    evaluation: dict[str, Any] | None = None

    @property
    def compression_ratio(self) -> float | None:
        sent = self.wan_bytes_up + self.wan_bytes_down
        return self.fp32_bytes_equivalent / sent if sent else None


async def run_demo(options: DemoOptions, *, echo: Callable[[str], None] = print) -> DemoSummary:
    """Run the demo to the end of its job and return (and write) its summary."""
    regions, work = _regions_and_workdir(options)
    examples = find_examples(options.examples)
    try:  # before anything is written or started
        placement = place(await asyncio.to_thread(visible_devices), regions, options.workers)
    except PlacementRefused as err:
        raise DemoFailed(str(err)) from None
    started = time.monotonic()

    echo(f"geofed demo: {len(regions)} regions ({', '.join(regions)}), {options.rounds} rounds")
    echo(f"  work dir  {work}")
    # Key generation and fsyncs: off the event loop, which already runs the broker.
    federation = await asyncio.to_thread(create_demo_federation, work / "pki", FEDERATION, regions)
    echo(f"  PKI       federation {FEDERATION!r}: a CA and {len(regions) + 2} certificates")

    quiet_broker_logging()
    http_port = unused_port()
    broker = BrokerHolder()
    await broker.start()
    async with (
        contextlib.AsyncExitStack() as stack,
        wan_links(options.wan, regions, http_port, always=options.chaos) as links,
    ):
        stack.push_async_callback(broker.stop)
        wan_ports = {region: link.port for region, link in links.items()}
        echo(f"  MQTT      embedded broker on 127.0.0.1:{broker.port} (plain text, loopback only)")
        if options.wan is not None:
            echo(f"  WAN       each region to the coordinator: {options.wan.describe()} (emulated)")
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
            task_options=options.task_options,
            customize=route_configs(wan_ports, overlap=options.overlap),
        )
        ssl_context = client_ssl_context(
            load_trust_bundle(federation.trust_bundle),
            federation.operator.cert,
            federation.operator.key,
        )
        base = f"https://localhost:{http_port}"
        timeout = aiohttp.ClientTimeout(total=30)
        async with (
            ChildSet(
                work / "logs",
                supervise=RestartPolicy(),
                on_event=lambda line: echo(f"  ! {line}"),
            ) as children,
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ssl_context), timeout=timeout
            ) as http,
        ):
            await _start_federation(
                children, http, base, configs, federation, placement, options, echo
            )
            monkey = None
            if options.chaos:
                plan = plan_chaos(options.rounds, regions)
                faults = ", ".join(f"{f.kind} {f.target} after round {f.after_round}" for f in plan)
                echo(f"  chaos     {faults}")
                monkey = ChaosMonkey(plan, children, broker, links, echo, started=started)
                chaos_task = asyncio.create_task(
                    monkey.run(lambda: _published_rounds(http, base, configs.job_id))
                )
                stack.push_async_callback(_cancel, chaos_task)
            echo("")
            summary = await _follow(
                http, base, configs.job_id, regions, children, options, started, echo
            )
            summary.restarts = children.restarts()
            if monkey is not None:
                await _cancel(chaos_task)
                summary.chaos = await _judge_chaos(http, base, configs.job_id, regions, monkey)
            echo("")
            echo("stopping the federation ...")
    await _conclude(summary, work, regions, configs.job_id, echo)
    return summary


def _regions_and_workdir(options: DemoOptions) -> tuple[list[str], Path]:
    """The demo's regions and its (new, empty) work directory; :class:`DemoFailed` says
    what is wrong with the options."""
    if not 1 <= options.regions <= len(DEMO_REGIONS):
        raise DemoFailed(
            f"--regions must be between 1 and {len(DEMO_REGIONS)}: the example policies "
            f"describe {', '.join(DEMO_REGIONS)}"
        )
    if options.rounds < 1:
        raise DemoFailed("--rounds must be at least 1")
    work = options.workdir.resolve()
    if work.exists() and any(work.iterdir()):
        raise DemoFailed(f"work dir {work} is not empty: pass a new --workdir or remove it")
    work.mkdir(parents=True, exist_ok=True)
    return list(DEMO_REGIONS[: options.regions]), work


async def _start_federation(
    children: ChildSet,
    http: aiohttp.ClientSession,
    base: str,
    configs: DemoConfigs,
    federation: DemoFederation,
    placement: Placement,
    options: DemoOptions,
    echo: Callable[[str], None],
) -> None:
    """Start the coordinator, then every region's agent, and submit the demo's job."""
    await children.start("coordinator", ["coordinator", "--config", str(configs.coordinator)])
    await _wait_ready(http, base, children, options.startup_timeout_s)
    echo(f"  HTTPS     coordinator on {base} (mTLS)")
    card = await asyncio.to_thread(write_browser_credential, federation.operator.directory)
    echo(f"  status    {base}{ApiPaths.UI} while the demo runs: import {card.p12} into")
    echo(f"            the browser (passphrase in {card.passphrase_file.name} beside it)")
    for region in configs.agents:
        await children.start(
            f"agent-{region}", ["agent", "--config", str(configs.agents[region])], group="agents"
        )
    echo(f"  placement {placement.describe()}")
    echo(f"  agents    {placement.agents_line()}")
    await _submit(http, base, configs.job)
    echo(f"  job       {configs.job_id!r} admitted by every region's policy")


async def _judge_chaos(
    http: aiohttp.ClientSession, base: str, job: str, regions: list[str], monkey: ChaosMonkey
) -> dict[str, Any]:
    """The chaos run's report: what was lost, and whether the regions agree."""
    report = judge_chaos(
        job,
        regions,
        await _audit(http, base),
        await _settled_statuses(http, base, job, regions),
        monkey.injected,
    )
    return report.to_json()


async def _conclude(
    summary: DemoSummary, work: Path, regions: list[str], job: str, echo: Callable[[str], None]
) -> None:
    """Measure, write and print the summary once the agents stopped; :class:`DemoFailed`
    when the job did not complete or the chaos run lost work."""
    # After the agents stopped: each wrote its last rounds' timeline on the way out.
    summary.compute_utilization = await asyncio.to_thread(
        utilization_by_region, work / "agents", regions, job
    )
    await asyncio.to_thread(_write_summary, work / "summary.json", summary)
    _print_summary(summary, work, echo)
    if summary.job_state != "completed":
        raise DemoFailed(f"job ended {summary.job_state!r}; logs are in {work / 'logs'}")
    if summary.chaos is not None and (summary.chaos["lost"] or not summary.chaos["regions_agree"]):
        raise DemoFailed(
            f"the chaos run lost work or left regions apart; see {work / 'summary.json'}"
        )


async def _published_rounds(http: aiohttp.ClientSession, base: str, job: str) -> int | None:
    """How many rounds the job has published; None while the coordinator cannot say."""
    try:
        status = await _get_json(http, base + ApiPaths.job(job))
    except (aiohttp.ClientError, TimeoutError):
        return None
    round_ = status.get("round")
    return round_ if isinstance(round_, int) else None


async def _audit(http: aiohttp.ClientSession, base: str) -> list[dict[str, Any]]:
    """Every audit entry, page by page."""
    entries: list[dict[str, Any]] = []
    after = 0
    while True:
        page = await _get_json(http, f"{base}{ApiPaths.AUDIT}?limit=1000&after={after}")
        batch = page["entries"]
        entries.extend(batch)
        if len(batch) < 1000:
            return entries
        after = int(batch[-1]["seq"])


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if not task.cancelled() and task.exception() is not None:
        log.warning("the chaos run failed: %s", task.exception())


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


#: How long the chaos verdict waits for every region's status to name the job again: a
#: region whose broker connection was cut last may still be reconnecting.
SETTLE_S = 15.0


async def _settled_statuses(
    http: aiohttp.ClientSession, base: str, job: str, regions: Sequence[str]
) -> list[dict[str, Any]]:
    """The regions' statuses once each names ``job`` (or as they are after SETTLE_S)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        statuses: list[dict[str, Any]] = (await _get_json(http, base + ApiPaths.REGIONS))["regions"]
        named = {str(s.get("region")) for s in statuses if s.get("job") == job}
        if named >= set(regions) or time.monotonic() >= deadline:
            return statuses
        await asyncio.sleep(0.5)


async def _scrape(
    http: aiohttp.ClientSession, base: str, totals: RestartSafeTotals, status: dict[str, Any]
) -> tuple[int, int, int]:
    """(bytes up, bytes down, fp32-equivalent bytes) so far. Up: the accepted deltas'
    bytes, from the coordinator's durable receipts (the job status's ``deltas``); down
    and fp32: its counters, carried across its restarts."""
    async with http.get(f"{base}/metrics") as response:
        response.raise_for_status()
        _, down, fp32 = totals.observe(wan_bytes(await response.text()))
    return int(status.get("deltas", {}).get("bytes", 0)), down, fp32


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
    totals = RestartSafeTotals()
    finished_at: float | None = None
    state = "running"
    echo(
        f"{'round':>5}  {'global val loss':>15}  {'WAN up':>9}  {'WAN down':>9}  "
        f"{'vs fp32':>7}  {'elapsed':>7}  compute utilization ({' '.join(regions)})"
    )
    while True:
        if time.monotonic() > deadline:
            raise DemoFailed(f"the job did not finish within {options.timeout_s:.0f} s")
        children.check_alive()
        try:
            status = await _get_json(http, base + ApiPaths.job(job))
            up, down, fp32 = await _scrape(http, base, totals, status)
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
            util = await asyncio.to_thread(
                utilization_by_region, options.workdir.resolve() / "agents", regions, job
            )
            echo(
                f"{number:>5}  {value:>15.4f}  {_mb(up):>9}  {_mb(down):>9}  "
                f"{ratio:>7}  {elapsed:>6.0f}s  {format_utilization(util)}"
            )
            records.append(DemoRound(number, value, elapsed, up, down, fp32, util))
        if state in _TERMINAL:
            if state != "completed" or seen_val_round >= options.rounds:
                break
            # Completed: the coordinator finishes evaluating the last parameters first.
            finished_at = finished_at or time.monotonic()
            if time.monotonic() - finished_at > _FINAL_EVALUATION_GRACE_S:
                break
        await asyncio.sleep(1.0)
    status = await _get_json(http, base + ApiPaths.job(job))
    up, down, fp32 = await _scrape(http, base, totals, status)
    return DemoSummary(
        rounds_completed=int(status.get("round", len(records))),
        initial_loss=initial,
        final_loss=records[-1].val_loss if records else initial,
        wan_bytes_up=up,
        wan_bytes_down=down,
        fp32_bytes_equivalent=fp32,
        deltas_accepted=int(status.get("deltas", {}).get("accepted", 0)),
        regions=regions,
        job=job,
        job_state=state,
        wall_seconds=time.monotonic() - started,
        rounds=records,
        evaluation=status.get("evaluation"),
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
    if summary.compute_utilization:
        echo(f"  compute utilization: {_utilization_line(summary.compute_utilization)}")
    if summary.restarts:
        restarts = ", ".join(f"{name} {count}x" for name, count in summary.restarts.items())
        echo(f"  restarted: {restarts}")
    if summary.chaos is not None:
        injected = summary.chaos["injected"]
        echo(f"  chaos: {len(injected)} fault(s) injected")
        for fault in injected:
            what = f"{fault['kind']} {fault['target']} at round {fault['round']}"
            echo(f"    {what}: {fault['detail']}")
        lost = summary.chaos["lost"]
        echo(f"  lost: {'nothing acknowledged' if not lost else '; '.join(lost)}")
        for region, verdict in summary.chaos["regions"].items():
            echo(f"    {region}: {verdict}")
    echo(f"  summary: {work / 'summary.json'}   logs: {work / 'logs'}")


def _utilization_line(values: dict[str, float | None]) -> str:
    return ", ".join(f"{r} {'-' if v is None else f'{v:.0%}'}" for r, v in values.items())
