"""The regional agent: follows the control plane and runs this region's rounds.

:class:`Agent` owns every task of the daemon: the MQTT connection (Last Will
``offline``), the status reporter, the worker group (started once, kept alive across
rounds, restarted by its own supervision), and the round driver. It subscribes to every
job's round announcement (``jobs/+/round``) and to its own commands
(``regions/<region>/commands``), drops repeated messages by id, and runs one round at a
time through :class:`~regional_agent.rounds.pipeline.RoundPipeline`.

Scheduling: the latest announcement of each job is kept; a job's round is run when it
is ``open``, this region participates, the job is neither paused nor cancelled, and the
round has not ended for this region yet. A newer announcement of the running job (the
round closed, moved on, was paused) cancels the running round, except while its delta
is being uploaded: then the upload finishes (accepted, or refused as a straggler).

An earlier round announced after a later one (a coordinator restored from an older
backup) is run again; the pipeline confirms the rollback with the coordinator before it
discards the job's regional state.

A ``checkpoint`` command (the region's hardware risk made the coordinator snapshot)
leaves an ask for a regional checkpoint in the hand-off directory, which the workers
honour at the end of the first round they finish from the command's round on.

Commands: ``pause``/``resume`` hold and release a job, ``cancel`` drops it, ``resync``
discards the held θ (the next sync is a full resync), ``drain`` finishes the round in
progress and then stops the agent cleanly. :meth:`Agent.request_drain` (SIGTERM, a spot
notice) finishes the round in progress only if it fits in ``drain.grace_s``
(:mod:`regional_agent.drain`), else stops it at the next step, where the workers keep its
inner state and resume it after the restart.

:meth:`Agent.run` returns after :meth:`Agent.request_stop` or a finished drain, having
stopped the worker group and said ``offline``; it raises :class:`AgentFailed` when the
agent cannot go on (the worker group failed past its relaunch cap, the broker refused a
subscription).

Metrics: the agent feeds its :class:`~regional_agent.metrics.AgentMetrics` with how each
round ended, whether a job it takes part in is under way (the wall time of compute
utilisation), and drops a job's series once the coordinator announces it done or
cancelled; the pipeline, the synchronizer and the uploader record the rest. Each round's
timeline (:mod:`regional_agent.rounds.timeline`) is kept in the state directory; the next
announcement of a job ends the previous round's ``wait``.
:meth:`Agent.refresh_metrics` reads the live values (MQTT connection, worker-group
restarts) before each scrape.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from geofed.backoff import Backoff, Retry
from geofed.control import (
    Command,
    ControlClient,
    Deduplicator,
    HardwareSummary,
    MessageError,
    RoundAnnouncement,
    TopicError,
    Topics,
    decode,
)
from geofed.control.messages import RegionState
from geofed.data.location import DatasetLocation
from geofed.pki import client_ssl_context, mqtt_username
from geofed.timeouts import wait_event
from geofed.tracing import REGION_KEY, RoundTracer
from policies import PolicySet
from regional_agent.config import AgentConfig, dataset_locations, training_datasets
from regional_agent.credentials import Credentials
from regional_agent.drain import DrainDecision, decide
from regional_agent.launch.backends import make_launcher
from regional_agent.launch.exclusion import NodeExclusions, apply_exclusions
from regional_agent.launch.launcher import Launcher
from regional_agent.launch.worker_group import WorkerGroup, WorkerGroupConfig, WorkerGroupFailed
from regional_agent.metrics import AgentMetrics
from regional_agent.rounds.measurements import RoundMeasurements
from regional_agent.rounds.pipeline import PipelineRegion, RetryLater, RoundEnd, RoundPipeline
from regional_agent.rounds.round_spans import RegionTraces
from regional_agent.rounds.schedule import Running, Schedule, Stop
from regional_agent.rounds.timeline import RoundTimeline, Timeline
from regional_agent.state import AgentState
from regional_agent.status import StatusReporter, offline_status, probe_capacity
from regional_agent.telemetry.history import HARDWARE_HISTORY_FILE, HardwareHistory
from regional_agent.telemetry.node import NodeTelemetry, TelemetrySampler, summarize
from regional_agent.transfer.coordinator_client import CoordinatorClient, build_session
from regional_agent.transfer.sync import Synchronizer
from regional_agent.transfer.uploader import Uploader

log = logging.getLogger(__name__)

T = TypeVar("T")
Clock = Callable[[], datetime]
#: How often an idle agent checks that its worker group is still alive.
_WATCH_INTERVAL_S = 1.0
#: How old the node's last reading may be in a status, and how long a new one may take.
HARDWARE_MAX_AGE_S = 10.0
HARDWARE_READ_S = 1.0


class AgentFailed(Exception):
    """The agent cannot go on; the daemon exits with status 1."""


@dataclass
class _RoundTask:
    job: str
    round: int
    task: asyncio.Task[RoundEnd]
    announcement: RoundAnnouncement


def _utc_now() -> datetime:
    return datetime.now(UTC)


class Agent:
    """One region's agent (see the module docstring)."""

    def __init__(
        self,
        config: AgentConfig,
        credentials: Credentials,
        policies: PolicySet,
        *,
        launcher: Launcher | None = None,
        clock: Clock = _utc_now,
        rng: random.Random | None = None,
        metrics: AgentMetrics | None = None,
        worker_environ: Mapping[str, str] | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        """``metrics`` default to a private registry; ``worker_environ`` is the local
        launcher's base environment (default: this process's); ``on_ready()`` runs once
        the worker group is up and the agent takes rounds."""
        self._config = config
        self._credentials = credentials
        self._clock = clock
        self._rng = rng or random.Random()
        self._metrics = metrics or AgentMetrics(CollectorRegistry(), config.region)
        self._measurements = RoundMeasurements(self._metrics)
        self._on_ready = on_ready
        self._refreshing = asyncio.Lock()
        self._ended_jobs: set[str] = set()
        # Ended jobs whose hand-off files (regional checkpoint, last rounds) are to go.
        self._ended_handoff: set[str] = set()
        self._region = PipelineRegion(
            credentials, policies, training_datasets(config, policies), dataset_locations(config)
        )
        self._topics = Topics(config.federation)
        timeouts = config.timeouts
        status_topic = self._topics.region_status(config.region)
        tls = None
        if config.mqtt.tls:
            tls = client_ssl_context(
                credentials.bundle, credentials.cert_file, credentials.key_file
            )
        self._control = ControlClient(
            config.mqtt.host,
            config.mqtt.port,
            client_id=mqtt_username(credentials.identity),
            tls=tls,
            # Built again for each connection: a Will is the newest word of its connection
            # only, and a second one must not look like a repeat of the first.
            will=lambda: offline_status(status_topic, config.region, "connection lost"),
            keepalive_s=max(1, round(timeouts.heartbeat_s)),
            timeout_s=timeouts.request_s,
            rng=self._rng,
        )
        workers = config.workers
        self._workers = WorkerGroup(
            config.workers_dir,
            launcher or make_launcher(workers, config.workers_dir, environ=worker_environ),
            WorkerGroupConfig(
                start_timeout_s=workers.start_timeout_s, max_relaunches=workers.max_relaunches
            ),
            rng=self._rng,
        )
        self._exclusions = NodeExclusions(workers.stragglers, workers.nnodes)
        self._status = StatusReporter(
            self._control,
            self._topics,
            config.region,
            interval_s=timeouts.heartbeat_s,
            timeout_s=timeouts.request_s,
            restarts=lambda: self._workers.restart_count,
            capacity=lambda: probe_capacity(workers.count, workers.backend),
            hardware=self._hardware,
        )
        self._state = AgentState(config.state_dir)
        history = HardwareHistory(config.state_dir / HARDWARE_HISTORY_FILE)
        self._telemetry = TelemetrySampler(NodeTelemetry(config.state_dir, history=history.observe))
        self._traces = RegionTraces(
            RoundTracer.configured(config.tracing, "geofed-agent", {REGION_KEY: config.region})
        )
        self._timeline = Timeline(config.state_dir, on_round=self._round_timed)
        self._dedup = Deduplicator()
        self._schedule = Schedule(config.region)
        self._running: _RoundTask | None = None
        # Rounds that ended in RetryLater in a row; each waits longer before the next.
        self._retry = Retry(Backoff(initial_s=1.0, max_s=30.0), rng=self._rng)
        self._wakeup = asyncio.Event()
        self._stop = asyncio.Event()
        self._drain: asyncio.Task[None] | None = None
        #: What the last SIGTERM decided (finish the round or stop it), and why.
        self.drain_decision: DrainDecision | None = None
        self._pipeline: RoundPipeline | None = None
        #: (job, round, outcome) of every round this agent finished, in order.
        self.history: list[tuple[str, int, str]] = []

    @property
    def status(self) -> StatusReporter:
        return self._status

    @property
    def workers(self) -> WorkerGroup:
        return self._workers

    @property
    def metrics(self) -> AgentMetrics:
        return self._metrics

    async def refresh_metrics(self) -> None:
        """Bring the metrics read from live state up to date (before a scrape)."""
        # One at a time: restart counts read out of order would look like a new group.
        async with self._refreshing:
            restarts = await asyncio.to_thread(lambda: self._workers.restart_count)
            self._metrics.observe_worker_restarts(restarts)
            self._metrics.set_mqtt_connected(self._control.connected.is_set())
            sample = await self._telemetry.sample()
            if sample is not None:
                self._metrics.hardware.sampled(self._telemetry.telemetry.node, *sample)

    async def _hardware(self) -> HardwareSummary | None:
        """The node for the region's status: the last reading if recent, else a new one."""
        sample = await self._telemetry.recent(HARDWARE_MAX_AGE_S, HARDWARE_READ_S)
        return None if sample is None else summarize(sample, self._telemetry.telemetry.node)

    def health(self) -> dict[str, str]:
        """What ``/healthz`` tells besides being alive."""
        return {
            "state": self._status.state,
            "mqtt": "connected" if self._control.connected.is_set() else "disconnected",
            "workers": "running" if self._workers.running else "not running",
        }

    def request_stop(self) -> None:
        """Ask :meth:`run` to stop the agent now (SIGINT, a second SIGTERM).

        The round in progress is cancelled and the workers stop at the next step.
        """
        self._stop.set()

    def request_drain(self) -> None:
        """Drain, then stop (SIGTERM, a spot notice): see :mod:`regional_agent.drain`.

        No new round starts; the round in progress finishes if it fits in the drain
        grace (it is stopped at the grace's end anyway), else it stops at the next step
        and the workers keep its inner state for the restart to resume.
        """
        if self._drain is None and not self._stop.is_set():
            notice_at = asyncio.get_running_loop().time()
            self._drain = asyncio.create_task(self._drain_then_stop(notice_at), name="drain")

    async def _drain_then_stop(self, notice_at: float) -> None:
        loop = asyncio.get_running_loop()
        self._schedule.draining = True
        running = self._running
        position = None
        if running is not None and not running.task.done() and self._pipeline is not None:
            position = await self._pipeline.position(running.announcement)
        decision = decide(
            position, notice_at=notice_at, now=loop.time(), grace_s=self._config.drain.grace_s
        )
        self.drain_decision = decision
        log.info("drain on SIGTERM: %s", decision.reason)
        if decision.finish and running is not None:
            self._status.update(
                "draining", job=running.job, round=running.round, detail=decision.reason
            )
            await asyncio.wait([running.task], timeout=max(decision.deadline - loop.time(), 0.0))
            if not running.task.done():
                log.warning(
                    "job %s round %d: the drain grace is over; stopping at the next step",
                    running.job,
                    running.round,
                )
        self._stop.set()

    def use_policies(
        self,
        policies: PolicySet,
        datasets: tuple[str, ...],
        locations: Mapping[str, DatasetLocation],
    ) -> None:
        """Decide residency under reloaded ``policies``, and read the datasets from
        reloaded ``locations``, from the next round on (SIGHUP)."""
        self._region = PipelineRegion(self._credentials, policies, datasets, locations)
        if self._pipeline is not None:
            self._pipeline.use_region(self._region)

    # -- lifecycle --------------------------------------------------------------------

    async def run(self) -> None:
        """Run until stopped or drained; raise :class:`AgentFailed` if it cannot go on."""
        config = self._config
        await asyncio.to_thread(self._state.prepare)
        async with build_session(config, self._credentials) as session:
            client = CoordinatorClient(session, config.coordinator_url, config.timeouts)
            self._pipeline = RoundPipeline(
                self._region,
                self._state,
                self._workers,
                Synchronizer(
                    client,
                    self._credentials.trust,
                    clock=self._clock,
                    metrics=self._metrics,
                    download_window=config.transfer.download_window,
                    theta_file_every=config.transfer.theta_file_every,
                ),
                Uploader(
                    client,
                    config.region,
                    rng=self._rng,
                    metrics=self._metrics,
                    window=config.transfer.upload_window,
                ),
                self._status,
                metrics=self._metrics,
                measurements=self._measurements,
                train_timeout_s=config.timeouts.round_deadline_s,
                clock=self._clock,
                timeline=self._timeline,
            )
            await self._control.subscribe(self._topics.all_job_rounds(), self._on_announcement)
            await self._control.subscribe(
                self._topics.region_commands(config.region), self._on_command
            )
            self._control.on_connect(self._on_connect)
            background = [
                asyncio.create_task(self._control.run(), name="mqtt"),
                asyncio.create_task(self._status.run(), name="status"),
            ]
            try:
                self._status.update("online", detail="starting the worker group")
                if await self._until_stop(self._workers.start(), background):
                    self._status.update("online", detail="ready")
                    if self._on_ready is not None:
                        self._on_ready()
                    await self._until_stop(self._drive(), background)
            finally:
                await self._shutdown(background)

    async def _until_stop(
        self, work: Coroutine[Any, Any, T], background: list[asyncio.Task[None]]
    ) -> bool:
        """Run ``work`` until it ends (True) or a stop is requested (False).

        A background task that ends first means the agent lost a part it cannot run
        without; that raises :class:`AgentFailed`.
        """
        task = asyncio.create_task(work)
        stop = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait([task, stop, *background], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not task.done():
                task.cancel()
            await asyncio.wait([task, stop])
        if task.done() and not task.cancelled():
            error = task.exception()
            if isinstance(error, WorkerGroupFailed | AgentFailed):
                raise AgentFailed(str(error)) from error
            if error is not None:
                raise error
            return True
        for part in background:
            if part.done():
                reason = "stopped" if part.cancelled() else repr(part.exception())
                raise AgentFailed(f"the {part.get_name()} task ended: {reason}")
        return False

    async def _shutdown(self, background: list[asyncio.Task[None]]) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.cancel()
            await asyncio.wait([self._drain])
        self._status.update("offline", detail="stopping")
        self._metrics.set_participating(False)
        self._telemetry.close()
        try:
            status = await self._workers.stop()
            log.info("worker group stopped (status %s)", status)
        except Exception:
            log.exception("stopping the worker group failed")
        await self._timeline.flush()
        status_task = background[1]
        status_task.cancel()
        await asyncio.wait([status_task])
        await self._control.close(self._status.offline("stopped"))
        await asyncio.wait([background[0]], timeout=self._config.timeouts.request_s)
        # Last: a collector that is down costs the stop its timeout at most, after the
        # offline status went out.
        await asyncio.to_thread(self._traces.shutdown, self._config.tracing.timeout_s)
        for task in background:
            task.cancel()
        await asyncio.wait(background)

    # -- the round driver -------------------------------------------------------------

    async def _drive(self) -> None:
        while True:
            if not self._workers.running:
                raise AgentFailed("the worker group is not running")
            announcement = self._schedule.next_round()
            if announcement is not None:
                await self._run_round(announcement)
                continue
            if self._schedule.draining:
                log.info("drained: no round in progress; stopping")
                return
            await self._forget_ended_jobs()
            await wait_event(self._wakeup, _WATCH_INTERVAL_S)
            self._wakeup.clear()

    async def _run_round(self, announcement: RoundAnnouncement) -> None:
        assert self._pipeline is not None  # set by run() before the driver starts
        job, round_ = announcement.job, announcement.round
        resync = self._schedule.take_resync(job)
        task = asyncio.create_task(self._pipeline.run(announcement, resync=resync))
        self._running = _RoundTask(job, round_, task, announcement)
        try:
            end = await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            if resync:
                self._schedule.request_resync(job)
            log.info("job %s round %d: stopped early", job, round_)
            if self._schedule.paused(job):
                self._status.update("paused", job=job, round=round_, detail="job paused")
            return
        except RetryLater as exc:
            self._status.update("error", job=job, round=round_, detail=f"will retry: {exc}")
            await self._pause(self._retry.failed())
            return
        else:
            # Before the job's series may be dropped below, if the job ended meanwhile.
            self._metrics.round_ended(job, end.outcome)
        finally:
            self._running = None
            self._metrics_follow_schedule()
        self._retry.reset()
        final = end.outcome == "accepted"
        self._schedule.settle(job, round_, deadline=None if final else announcement.deadline)
        self.history.append((job, round_, end.outcome))
        state: RegionState = "online" if end.outcome in ("accepted", "straggler") else "error"
        self._status.update(
            state,
            job=job,
            round=round_,
            params_hash=end.params_hash,
            train_loss=end.train_loss,
            detail=end.detail,
            refused=end.by_region,
        )
        if state == "error":
            log.error("job %s round %d: %s", job, round_, end.detail)
        await self._leave_out_stragglers(job, round_)

    async def _leave_out_stragglers(self, job: str, round_: int) -> None:
        """At this round boundary, relaunch the group without its straggling nodes, or
        with a node left out before back (``workers.stragglers``)."""
        if self._schedule.draining:
            return  # the group stops anyway: no relaunch holds the drain up
        verdict = self._measurements.verdict(job, round_)
        try:
            change = await apply_exclusions(self._workers, self._exclusions, verdict)
        except Exception as exc:  # the group is stopped: the agent cannot go on
            raise AgentFailed(f"relaunching the worker group failed: {exc}") from exc
        if change is not None:
            self._metrics.nodes_excluded(len(change.excluded))

    async def _pause(self, delay: float) -> None:
        """Wait ``delay`` seconds, or less if something new arrives."""
        self._wakeup.clear()
        await wait_event(self._wakeup, delay)

    def _stop_running(self, stop: Stop | None) -> None:
        running = self._running
        if stop is None or running is None or running.job != stop.job or running.task.done():
            return
        log.info("job %s round %d: stopping it (%s)", stop.job, running.round, stop.reason)
        running.task.cancel()

    def _metrics_follow_schedule(self) -> None:
        """Wall time runs while a job is under way; ended jobs lose their series."""
        self._metrics.set_participating(self._schedule.participating())
        running = self._running.job if self._running is not None else None
        for job in sorted(self._ended_jobs):
            if job != running:
                self._metrics.forget_job(job)
                self._measurements.forget(job)
                self._ended_handoff.add(job)
        self._ended_jobs = {job for job in self._ended_jobs if job == running}

    async def _forget_ended_jobs(self) -> None:
        """Remove ended jobs' regional checkpoints and round files (disk stays bounded),
        once the worker group has no instruction in hand: a round it still trains would
        write them again."""
        handoff = self._workers.handoff
        while self._ended_handoff:
            if await asyncio.to_thread(handoff.pending_instruction) is not None:
                return  # the next idle pass tries again
            job = self._ended_handoff.pop()
            try:
                await asyncio.to_thread(handoff.forget_job, job)
            except OSError as exc:
                log.warning("job %s ended; cannot remove its regional checkpoint: %s", job, exc)
            else:
                log.info("job %s ended: removed its regional checkpoint", job)

    async def _ask_checkpoint(self, job: str, round_: int, reason: str) -> None:
        log.warning("job %s: a regional checkpoint from round %d is asked: %s", job, round_, reason)
        try:
            await asyncio.to_thread(self._workers.handoff.ask_checkpoint, job, round_)
        except OSError as exc:  # the cadence still saves; nothing else waits on the ask
            log.warning("job %s: cannot leave the checkpoint ask: %s", job, exc)

    def _round_timed(self, done: RoundTimeline) -> None:
        self._traces.finished(done)
        self._metrics.round_phases(done.job, {name: done.seconds(name) for name in done.phases})

    def _running_view(self) -> Running | None:
        running = self._running
        if running is None:
            return None
        return Running(running.job, running.round, self._status.state == "uploading")

    # -- control-plane messages -------------------------------------------------------

    async def _on_connect(self) -> None:
        self._status.mark_stale()

    async def _on_announcement(self, topic: str, payload: bytes) -> None:
        try:
            announcement = decode(payload, RoundAnnouncement)
            topic_job = self._topics.parse(topic).job
        except (MessageError, TopicError) as exc:
            log.warning("ignoring a message on %s: %s", topic, exc)
            return
        if topic_job != announcement.job:
            log.warning("ignoring an announcement of job %s on %s", announcement.job, topic)
            return
        if not self._dedup.first_time(announcement.message_id):
            return
        self._stop_running(self._schedule.offer(announcement, self._running_view()))
        self._traces.announced(announcement)
        if self._pipeline is not None:  # overlap: delayed; a round started ahead may end here
            await self._pipeline.announced(announcement)
        job = announcement.job
        # The next round's announcement ends the previous rounds' wait on the timeline.
        if announcement.state in ("open", "done", "cancelled"):
            self._timeline.announced(job, announcement.round, final=announcement.state != "open")
        if announcement.state in ("done", "cancelled"):
            self._ended_jobs.add(job)
        self._metrics_follow_schedule()
        if self._running is None and announcement.state == "paused":
            self._status.update("paused", job=job, detail="job paused by the coordinator")
        self._wakeup.set()

    async def _on_command(self, topic: str, payload: bytes) -> None:
        try:
            command = decode(payload, Command)
        except MessageError as exc:
            log.warning("ignoring a message on %s: %s", topic, exc)
            return
        if not self._dedup.first_time(command.message_id):
            return
        log.info("command %s for job %s: %s", command.action, command.job, command.reason)
        self._stop_running(self._schedule.command(command, self._running_view()))
        self._metrics_follow_schedule()
        job, reason = command.job, command.reason
        if command.action == "checkpoint" and job is not None and command.round is not None:
            if self._schedule.ended(job):  # its files go with it; an ask would outlive them
                log.info("job %s ended: no regional checkpoint to take", job)
            else:
                await self._ask_checkpoint(job, command.round, reason)
        elif command.action == "drain":
            self._status.update("draining", detail=reason or "finishing the current round")
        elif command.action == "pause" and job is not None:
            self._status.update("paused", job=job, detail=reason or "paused by the coordinator")
        elif command.action == "cancel" and job is not None:
            self._status.update("online", job=job, detail=f"job {job} cancelled")
        self._wakeup.set()
