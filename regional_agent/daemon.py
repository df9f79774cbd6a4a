"""The agent daemon's entry point: load the configuration, run the agent, stop on SIGTERM.

SIGHUP reloads what a running agent can change (:mod:`regional_agent.reload`): the
region's policy and datasets, the trust bundle's revocations and ``log_level``; it logs
what was reloaded, what needs a restart, and refuses (changing nothing) a file that does
not load. No exit leaves the worker group behind: a stop stops it, and the launcher
process (the elastic launcher of :class:`~regional_agent.launch.launcher.LocalElasticLauncher`,
or ``srun`` under :class:`~regional_agent.launch.slurm.SlurmLauncher`) gets SIGTERM
from the kernel when the agent dies, even by SIGKILL.

Exit codes are :class:`geofed.exit_codes.ExitCode`, the table both daemons share:
``OK`` (0) when stopped cleanly (SIGTERM or SIGINT, or a ``drain`` command finished),
``RUNTIME`` (1) when the worker group failed past its relaunch cap, the broker refused a
subscription, the metrics listener cannot bind its address or an unexpected error
occurred (restarting may help), ``CONFIG`` (2) for a bad config file, policy file or
identity file it names, or a malformed ``$NOTIFY_SOCKET``/``$WATCHDOG_USEC``
(restarting will not help until the files are fixed).

On SIGTERM (a spot notice) the agent drains (:mod:`regional_agent.drain`): it starts no
new round and finishes the one in progress if its measured pace says it fits in
``drain.grace_s`` (stopping it at the grace's end anyway), else stops it at the next
inner step; its durable state lets the next start retrain that round. SIGINT, or a
second SIGTERM, stops at once. Then it stops the worker group (a stop request, then
SIGKILL after its deadline), publishes ``offline`` and exits.

Operations. The daemon creates the Prometheus registry and the agent's metrics and
serves them on the metrics listener (:mod:`regional_agent.metrics_server`), bound before
the worker group starts so that a taken port fails fast and closed last so that the
shutdown can be watched. Under systemd (``Type=notify``, :mod:`geofed.sdnotify`; a no-op
elsewhere) it sends:

- ``EXTEND_TIMEOUT_USEC`` before starting the worker group, so that
  ``workers.start_timeout_s`` rather than ``TimeoutStartSec=`` bounds that start;
- ``READY=1`` once the metrics listener is bound and every rank of the worker group is
  ready: from then on the agent takes rounds. It waits for neither the broker nor the
  coordinator: an MQTT outage is retried with back-off while the agent runs (``STATUS=``
  and ``geofed_agent_mqtt_connected`` show it), and the coordinator is first needed when
  a round is announced;
- ``STATUS=`` on every change of the region's status, the one published retained on
  MQTT (``training job llm round 3: 50 steps``);
- ``STOPPING=1`` when SIGTERM or SIGINT arrives, or when the agent stops by itself
  (drained, failed);
- ``WATCHDOG=1`` every half of ``WatchdogSec=`` from the event loop (a task of the
  daemon), so a stuck loop gets the daemon killed and restarted.

The worker group inherits the environment without the notify variables: workers never
talk to systemd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry

from geofed.control import RegionStatus
from geofed.exit_codes import ExitCode
from geofed.heap import keep_mmap_threshold
from geofed.reload import apply_log_level
from geofed.reloader import Reloader
from geofed.sdnotify import (
    Notifier,
    NotifyEnvironmentError,
    run_watchdog,
    watchdog_interval,
    without_notify_env,
)
from policies import PolicyLoadError, PolicySet
from regional_agent.agent import Agent, AgentFailed
from regional_agent.config import (
    AgentConfig,
    AgentConfigError,
    load_config,
    load_region_policies,
)
from regional_agent.credentials import Credentials, CredentialsError, load_credentials
from regional_agent.metrics import AgentMetrics
from regional_agent.metrics_server import MetricsServer, MetricsServerError, metrics_server
from regional_agent.reload import PreparedAgentReload, apply_reload, prepare_reload
from regional_agent.status import describe

log = logging.getLogger(__name__)

#: Start-up beyond the worker group's own start (listener, state, first status).
_START_MARGIN_S = 30.0


def main(config_path: Path | str) -> int:
    """Run the agent configured by ``config_path``; return the process exit code."""
    keep_mmap_threshold()  # streamed θ and update buffers go back to the system when freed
    try:
        notifier = Notifier.from_env(os.environ)
        watchdog_s = watchdog_interval(os.environ)
    except NotifyEnvironmentError as exc:
        print(f"error: systemd environment: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    try:
        config = load_config(config_path)
        # The command line's level: what a file without log_level goes back to.
        default_level = logging.getLogger().level
        apply_log_level(config.log_level, default_level)
        credentials = load_credentials(config.identity, config.identity_uri)
        policies = load_region_policies(config)
    except AgentConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return ExitCode.CONFIG
    except (CredentialsError, PolicyLoadError) as exc:
        print(f"error: {config_path}: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    try:
        with notifier:
            asyncio.run(
                serve(
                    config,
                    credentials,
                    policies,
                    notifier=notifier,
                    watchdog_s=watchdog_s,
                    reload_from=(Path(config_path), default_level),
                )
            )
    except (AgentFailed, MetricsServerError) as exc:
        log.error("agent failed: %s", exc)  # noqa: TRY400 - the reason is the message
        return ExitCode.RUNTIME
    except Exception:
        log.exception("agent failed")
        return ExitCode.RUNTIME
    log.info("agent stopped")
    return ExitCode.OK


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _Signals:
    """What a stop signal does: the first SIGTERM drains (a spot notice: finish the round if
    the grace allows, :mod:`regional_agent.drain`), SIGINT or a second signal stops; systemd
    hears why once."""

    def __init__(self, agent: Agent, notifier: Notifier) -> None:
        self._agent = agent
        self._notifier = notifier
        self.stopping = False

    def stop(self, reason: str) -> None:
        if not self.stopping:
            self.stopping = True
            self._notifier.stopping(reason)

    def on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGTERM and not self.stopping:
            log.info("received %s; draining, then stopping", name)
            self.stop(f"offline: {name} received, draining")
            self._agent.request_drain()
            return
        log.info("received %s; stopping", name)
        self.stop(f"offline: {name} received, stopping")
        self._agent.request_stop()


def _on_sighup(
    loop: asyncio.AbstractEventLoop,
    agent: Agent,
    config: AgentConfig,
    credentials: Credentials,
    notifier: Notifier,
    reload_from: tuple[Path, int] | None,
) -> Reloader[PreparedAgentReload] | None:
    """SIGHUP reloads the config file ``reload_from`` names (its path, and the log level
    without its ``log_level``); without one it is ignored, with a warning."""
    if reload_from is None:
        loop.add_signal_handler(signal.SIGHUP, log.warning, "SIGHUP ignored: no config file")
        return None
    path, default_level = reload_from
    reloader = Reloader(
        lambda: prepare_reload(config, credentials, path),
        lambda prepared: apply_reload(agent, credentials, prepared, default_level),
        notifier,
        "configuration",
    )
    loop.add_signal_handler(signal.SIGHUP, reloader.request)
    return reloader


async def serve(
    config: AgentConfig,
    credentials: Credentials,
    policies: PolicySet,
    *,
    notifier: Notifier | None = None,
    watchdog_s: float | None = None,
    registry: CollectorRegistry | None = None,
    environ: Mapping[str, str] | None = None,
    reload_from: tuple[Path, int] | None = None,
) -> None:
    """Run an agent in this event loop until SIGTERM/SIGINT, a drain, or a failure.

    ``watchdog_s`` is :func:`geofed.sdnotify.watchdog_interval`'s answer; ``environ``
    the environment the worker group's is derived from (default: this process's);
    ``reload_from``: the config file SIGHUP reloads, and the log level without its
    ``log_level`` (None: SIGHUP is ignored, as by a daemon without a file).
    """
    notifier = notifier or Notifier(None)
    registry = CollectorRegistry() if registry is None else registry
    metrics = AgentMetrics(registry, config.region, peak_flops=config.workers.peak_flops)
    metrics.set_certificate_expiry("identity", credentials.certificate.not_valid_after_utc)
    listener: MetricsServer | None = None

    reloader: Reloader[PreparedAgentReload] | None = None

    def on_ready() -> None:
        where = f"metrics on {listener.url}" if listener is not None else "metrics disabled"
        notifier.ready(f"online: ready; {where}")
        if reloader is not None:
            reloader.serving = True

    agent = Agent(
        config,
        credentials,
        policies,
        metrics=metrics,
        worker_environ=without_notify_env(os.environ if environ is None else environ),
        on_ready=on_ready,
    )

    def tell_systemd(status: RegionStatus) -> None:
        notifier.status(describe(status))

    agent.status.add_listener(tell_systemd)
    signals = _Signals(agent, notifier)
    loop = asyncio.get_running_loop()
    for signum in _STOP_SIGNALS:
        loop.add_signal_handler(signum, signals.on_signal, signum)
    reloader = _on_sighup(loop, agent, config, credentials, notifier, reload_from)
    watchdog: asyncio.Task[None] | None = None
    try:
        async with contextlib.AsyncExitStack() as stack:
            if config.metrics.enabled:
                server = metrics_server(
                    config.metrics,
                    credentials,
                    registry,
                    refresh=agent.refresh_metrics,
                    health=agent.health,
                )
                listener = await stack.enter_async_context(server)
            if watchdog_s is not None:
                watchdog = asyncio.create_task(run_watchdog(notifier, watchdog_s), name="watchdog")
            log.info(
                "agent for region %s of federation %s starting (state in %s)",
                config.region,
                config.federation,
                config.state_dir,
            )
            notifier.extend_timeout(config.workers.start_timeout_s + _START_MARGIN_S)
            try:
                await agent.run()
            finally:
                signals.stop("offline: stopping")
    finally:
        if watchdog is not None:
            watchdog.cancel()
            await asyncio.wait([watchdog])
        for signum in (*_STOP_SIGNALS, signal.SIGHUP):
            loop.remove_signal_handler(signum)
        if reloader is not None:
            await reloader.close()
