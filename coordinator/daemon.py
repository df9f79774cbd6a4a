"""``geofed coordinator --config FILE``: load, serve until SIGTERM, stop cleanly.

SIGHUP reloads what a running coordinator can change (:mod:`coordinator.reload`): the
region policies, the trust bundle's revocations and ``log_level``; it logs what was
reloaded, what needs a restart, and refuses (changing nothing) a file that does not load.

Exit codes are :class:`geofed.exit_codes.ExitCode`, the table both daemons share:
``OK`` (0) after SIGTERM or SIGINT once in-flight writes are done, ``RUNTIME`` (1) when
the port cannot be bound, the state database is unusable or the daemon crashed,
``CONFIG`` (2) for a bad file (the config, the trust bundle, the credential, the
policies) or systemd environment, printed as ``file:line: key: message`` lines.

With ``state_store.leader_lease`` several coordinators share one PostgreSQL state and
one of them serves (:mod:`coordinator.ha.leadership`): the others stand by, serving only
reads on their address (:mod:`coordinator.api.standby`; ``/readyz`` 503), until the
leader's lease runs out or is released, then take over on the same address (a shared
name or virtual IP the agents use). A leader that loses its lease stops and
exits ``RUNTIME``, so that systemd restarts it as a standby; a clean stop releases it.

Under systemd (``Type=notify``, ``deploy/systemd``) it sends ``READY=1`` once it serves
(a standby: once it stands by, its ``STATUS=`` saying whom it waits for),
``WATCHDOG=1`` from its event loop every half of ``WatchdogSec=`` (a standby's too; a
stuck loop stops them), and ``STOPPING=1`` when SIGTERM arrives.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from coordinator.api.app import create_app
from coordinator.api.server import CoordinatorRunner
from coordinator.api.standby import standing_by
from coordinator.config import ConfigError, load_config
from coordinator.ha.leadership import Deposed, Leadership, holder_name
from coordinator.ha.lease import Fence
from coordinator.reload import apply_reload, prepare_reload
from coordinator.runtime import Runtime, load_runtime
from coordinator.scheduling.config import load_scheduling_config
from coordinator.state.store import StoreError
from geofed.exit_codes import ExitCode
from geofed.heap import keep_mmap_threshold
from geofed.reload import apply_log_level
from geofed.reloader import Reloader
from geofed.sdnotify import Notifier, NotifyEnvironmentError, run_watchdog, watchdog_interval

__all__ = ["main", "serve"]

log = logging.getLogger(__name__)


async def serve(
    runtime: Runtime,
    stop: asyncio.Event,
    *,
    registry: CollectorRegistry | None = None,
    on_ready: Callable[[int], None] | None = None,
    notifier: Notifier | None = None,
    watchdog_s: float | None = None,
    fence: Fence | None = None,
) -> None:
    """Serve ``runtime`` until ``stop`` is set; ``on_ready(port)`` once listening.

    ``fence``: the leader lease held, when coordinators share the state store.
    """
    notifier = notifier or Notifier(None)
    config = runtime.config
    app = create_app(runtime, registry=registry or CollectorRegistry(), fence=fence)
    runner = CoordinatorRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(
            runner, config.listen.host, config.listen.port, ssl_context=runtime.server_ssl()
        )
        await site.start()
        port = _bound_port(runner, config.listen.port)
        scheme = "https" if config.tls_enabled else "http"
        log.info(
            "coordinator %s serving on %s://%s:%d",
            runtime.signer.identity,
            scheme,
            config.listen.host,
            port,
        )
        if on_ready is not None:
            on_ready(port)
        notifier.ready(f"serving on {scheme}://{config.listen.host}:{port}")
        watchdog = None
        if watchdog_s is not None:
            watchdog = asyncio.create_task(run_watchdog(notifier, watchdog_s), name="watchdog")
        await stop.wait()
        log.info("stopping: finishing in-flight work")
        notifier.stopping("finishing in-flight work")
        if watchdog is not None:
            watchdog.cancel()
            await asyncio.wait([watchdog])
    finally:
        await runner.cleanup()


def _bound_port(runner: web.AppRunner, configured: int) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return configured


async def _run(
    runtime: Runtime,
    config_path: Path,
    notifier: Notifier,
    watchdog_s: float | None,
    default_level: int,
) -> None:
    """Serve until SIGTERM/SIGINT; ``default_level``: the log level without ``log_level``."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloader = Reloader(
        lambda: prepare_reload(runtime, config_path),
        lambda prepared: apply_reload(runtime, prepared, default_level),
        notifier,
        "configuration",
    )
    loop.add_signal_handler(signal.SIGHUP, reloader.request)

    def on_ready(port: int) -> None:
        del port
        reloader.serving = True

    try:
        await _lead_and_serve(runtime, stop, notifier, watchdog_s, on_ready)
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
        await reloader.close()
        if runtime.traces.enabled:  # the spans finished so far go out, if they can in time
            await asyncio.to_thread(runtime.traces.shutdown, runtime.config.tracing.timeout_s)


async def _lead_and_serve(
    runtime: Runtime,
    stop: asyncio.Event,
    notifier: Notifier,
    watchdog_s: float | None,
    on_ready: Callable[[int], None],
) -> None:
    """Serve; with a leader lease, stand by until leading and stop when deposed."""
    store = runtime.config.state_store
    if store.leader_lease is None or store.dsn is None:
        await serve(runtime, stop, notifier=notifier, watchdog_s=watchdog_s, on_ready=on_ready)
        return
    leadership = await Leadership.open(
        store.dsn, store.leader_lease, holder_name(runtime.signer.identity.uri), notifier
    )
    deposed: list[str] = []

    def on_deposed(reason: str) -> None:
        log.error("deposed: %s", reason)
        deposed.append(reason)
        stop.set()

    try:
        async with standing_by(runtime, leadership, notifier, watchdog_s):
            notifier.ready("standby: waiting for the leader lease")
            fence = await leadership.acquire(stop)
        if fence is None:
            return
        holding = asyncio.create_task(leadership.hold(on_deposed), name="leader-lease")
        try:
            await serve(
                runtime,
                stop,
                notifier=notifier,
                watchdog_s=watchdog_s,
                on_ready=on_ready,
                fence=fence,
            )
        finally:
            holding.cancel()
            await asyncio.wait([holding])
        if deposed:
            raise Deposed(deposed[0])
        await leadership.release()
    finally:
        await leadership.close()


def main(config_path: str | Path) -> int:
    """Run the coordinator; return the process exit code (see the module docstring)."""
    keep_mmap_threshold()  # decoded rounds and θ passes go back to the system when freed
    try:
        notifier = Notifier.from_env(os.environ)
        watchdog_s = watchdog_interval(os.environ)
        config = load_config(config_path)
        # The command line's level: what a file without log_level goes back to.
        default_level = logging.getLogger().level
        apply_log_level(config.log_level, default_level)
        runtime = load_runtime(config)
        load_scheduling_config(config.scheduling)  # its mistakes exit 2 too, named
    except NotifyEnvironmentError as exc:
        print(f"error: systemd environment: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return ExitCode.CONFIG
    try:
        with notifier:
            asyncio.run(_run(runtime, Path(config_path), notifier, watchdog_s, default_level))
    except (OSError, StoreError, Deposed) as exc:
        log.error("coordinator failed: %s", exc)  # noqa: TRY400 - the message says it all
        return ExitCode.RUNTIME
    except Exception:
        log.exception("coordinator crashed")
        return ExitCode.RUNTIME
    return ExitCode.OK
