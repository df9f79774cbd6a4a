"""Supervising a region's worker group from the agent's event loop.

:class:`WorkerGroup` starts the group once through a
:class:`~regional_agent.launch.launcher.Launcher`
and keeps it alive across rounds (starting workers costs seconds of interpreter and
torch start-up). Each round is a file exchange (:mod:`regional_agent.handoff`):
:meth:`WorkerGroup.run_round` writes the instruction and waits for the done marker.
A completed round is answered from disk without training, so an agent that restarts
mid-job asks again for the round it was waiting on and gets the same result.

Two layers restart crashed workers: the launcher restarts the whole group in place a
few times; when it gives up (or dies), the supervisor relaunches it after a jittered
exponential back-off, at most ``max_relaunches`` times in a row. Both count in
:attr:`WorkerGroup.restart_count`.

Nothing here blocks the event loop: file and process work runs in threads, every wait
has a timeout, and the one background task is cancelled and awaited by :meth:`stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from geofed.backoff import Backoff, Retry
from geofed.timeouts import Timeout, wait_for
from regional_agent.handoff.directory import ErrorMarker, HandoffDir
from regional_agent.handoff.messages import RoundInstruction, RoundResult
from regional_agent.launch.launcher import Launcher

log = logging.getLogger(__name__)
T = TypeVar("T")


class WorkerGroupError(Exception):
    """Base class of worker group errors."""


class WorkerGroupNotRunning(WorkerGroupError):
    """The group was not started, or has been stopped."""


class WorkerGroupFailed(WorkerGroupError):
    """The group kept crashing past its relaunch cap; the message holds the log tails."""


class RoundFailed(WorkerGroupError):
    """The workers refused or could not complete an instruction (their reason follows)."""


class RoundRefused(RoundFailed):
    """The workers decline the round themselves: the task's files in this region are not
    the ones the coordinator fingerprinted (their reason follows)."""


@dataclass(frozen=True, slots=True)
class WorkerGroupConfig:
    """Supervision settings of one worker group."""

    start_timeout_s: float = 300.0
    """From launch until every rank has joined the process group."""
    stop_timeout_s: float = 30.0
    """From the stop request until the processes are killed."""
    poll_interval_s: float = 0.05
    max_relaunches: int = 3
    """Consecutive relaunches after the launcher gave up, before the group is failed."""
    healthy_after_s: float = 300.0
    """A launch that lived this long resets the consecutive relaunch count."""
    backoff: Backoff = field(default_factory=lambda: Backoff(initial_s=1.0, max_s=60.0))
    log_tail_lines: int = 30

    def __post_init__(self) -> None:
        for name in ("start_timeout_s", "stop_timeout_s", "poll_interval_s", "healthy_after_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if self.max_relaunches < 0 or self.log_tail_lines < 0:
            raise ValueError("max_relaunches and log_tail_lines must be >= 0")


class WorkerGroup:
    """One region's worker group: start once, run many rounds, stop."""

    def __init__(
        self,
        workdir: str | Path,
        launcher: Launcher,
        config: WorkerGroupConfig | None = None,
        *,
        rng: random.Random | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.handoff = HandoffDir(workdir)
        self._launcher = launcher
        self._config = config if config is not None else WorkerGroupConfig()
        # Consecutive relaunches: reset once a launch stayed up healthy_after_s.
        self._retry = Retry(
            self._config.backoff, rng=rng if rng is not None else random.Random(), sleep=sleep
        )
        self._supervisor: asyncio.Task[None] | None = None
        self._inflight: asyncio.Future[Any] | None = None
        self._round_lock = asyncio.Lock()
        self._failure: WorkerGroupFailed | None = None
        self._stopped = False
        self._relaunches = 0
        self._launched_at = 0.0

    @property
    def launcher(self) -> Launcher:
        return self._launcher

    @property
    def running(self) -> bool:
        return self._supervisor is not None and not self._stopped and self._failure is None

    @property
    def relaunch_count(self) -> int:
        """Relaunches of the whole launcher by this supervisor."""
        return self._relaunches

    @property
    def restart_count(self) -> int:
        """Worker-group restarts of any kind since this supervisor started (for metrics)."""
        return self._launcher.restart_count + self._relaunches

    async def start(self) -> None:
        """Launch the group and wait until every rank is ready (or raise, leaving nothing)."""
        if self._supervisor is not None or self._stopped:
            raise WorkerGroupError("a worker group is started once; build a new one to restart")
        await self._launch()
        try:
            await self._ready_within("worker group start")
        except BaseException:
            await self.stop()
            raise

    async def run_round(self, instruction: RoundInstruction, timeout_s: float) -> RoundResult:
        """Have the group train ``instruction``; return its result.

        A round that already has a done marker is returned from disk without training,
        whether or not the group runs. Raises :class:`RoundFailed` when the workers
        cannot serve the instruction (:class:`RoundRefused` when they decline it),
        :class:`~geofed.timeouts.Timeout` after ``timeout_s``
        (the group keeps training; asking again keeps waiting for the same round).
        """
        job, round_ = instruction.job, instruction.round
        done = await asyncio.to_thread(self.handoff.read_completed, job, round_)
        if done is not None:
            return done
        return await wait_for(
            self._run(instruction, job, round_), timeout_s, f"round {round_} of job {job}"
        )

    async def collect_round(self, job: str, round_: int, timeout_s: float) -> RoundResult:
        """Wait for the outcome of a round whose instruction is already written (a
        delayed round: see :mod:`regional_agent.rounds.overlap_pipeline`); raises as
        :meth:`run_round` does."""
        return await wait_for(
            self._run(None, job, round_), timeout_s, f"round {round_} of job {job}"
        )

    async def stop(self) -> int | None:
        """Stop the group: stop request, then SIGKILL of every process after the deadline.

        Returns the launcher's exit status (0 when every worker stopped cleanly), or None
        if it had to be killed or never ran.
        """
        if self._stopped:
            return None
        self._stopped = True
        await self._end_supervisor()
        return await self._stop_launcher()

    async def relaunch(self, why: str) -> None:
        """Stop the group as :meth:`stop` does (the workers park their jobs: nothing is
        lost) and launch it again, e.g. with nodes left out or back; rounds asked
        meanwhile wait for it. Raises as :meth:`start` does, the group then stopped."""
        async with self._round_lock:
            self._check_running()
            log.warning("relaunching the worker group: %s", why)
            await self._end_supervisor()
            await self._stop_launcher()
            try:
                await self._launch()
                await self._ready_within("worker group relaunch")
            except BaseException:
                self._stopped = True
                await self._end_supervisor()
                await self._stop_launcher()
                raise

    async def _launch(self) -> None:
        """Launch the workers and supervise them (:meth:`start` and :meth:`relaunch`)."""
        await self._start_launcher()
        self._supervisor = asyncio.create_task(self._supervise(), name="worker-group-supervisor")

    async def _start_launcher(self) -> None:
        await asyncio.to_thread(self._prepare_workdir)
        await self._launcher_call(self._launcher.start)
        self._launched_at = self._retry.now()

    async def _end_supervisor(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._supervisor
        if self._inflight is not None:
            with contextlib.suppress(Exception):
                await self._inflight

    async def _stop_launcher(self) -> int | None:
        """Ask the workers to stop, kill what is left after the deadline; the status."""
        status: int | None = None
        if self._launcher.poll() is None and self._launcher.pid is not None:
            await asyncio.to_thread(self.handoff.request_stop)
            try:
                status = await wait_for(
                    self._until_exit(), self._config.stop_timeout_s, "worker group stop"
                )
            except Timeout:
                log.warning("worker group did not stop in time; killing it")
        await asyncio.to_thread(self._launcher.kill)
        return status

    # -- internals -----------------------------------------------------------------------

    def _prepare_workdir(self) -> None:
        self.handoff.root.mkdir(parents=True, exist_ok=True)
        self.handoff.clear_stop()

    async def _launcher_call(self, fn: Callable[[], T]) -> T:
        # Shielded so a cancelled caller never leaves a half-done start or kill behind;
        # stop() waits for it before touching the launcher.
        future: asyncio.Future[T] = asyncio.ensure_future(asyncio.to_thread(fn))
        self._inflight = future
        try:
            return await asyncio.shield(future)
        finally:
            if future.done():
                self._inflight = None

    def _check_running(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._supervisor is None or self._stopped:
            raise WorkerGroupNotRunning("the worker group is not running")

    async def _ready_within(self, what: str) -> None:
        """Wait for every rank to be ready; on expiry log the workers' last output, which
        says where they stood (importing, in the rendezvous, warming up)."""
        try:
            await wait_for(self._until_ready(), self._config.start_timeout_s, what)
        except Timeout:
            tails = await asyncio.to_thread(self._log_tails)
            log.warning("%s: not every rank was ready; last output:\n%s", what, tails)
            raise

    async def _until_ready(self) -> None:
        while True:
            self._check_running()
            statuses = await asyncio.to_thread(self.handoff.read_rank_statuses)
            launch_id = self._launcher.launch_id
            ready = [s for s in statuses if s.launch_id == launch_id and s.state == "ready"]
            if len(ready) >= self._launcher.world_size:
                return
            await asyncio.sleep(self._config.poll_interval_s)

    async def _until_exit(self) -> int:
        while True:
            status = self._launcher.poll()
            if status is not None:
                return status
            await asyncio.sleep(self._config.poll_interval_s)

    async def _run(
        self, instruction: RoundInstruction | None, job: str, round_: int
    ) -> RoundResult:
        async with self._round_lock:
            self._check_running()
            if instruction is not None:
                await asyncio.to_thread(self._submit, instruction)
            while True:
                outcome = await asyncio.to_thread(self._outcome, job, round_)
                if isinstance(outcome, RoundResult):
                    return outcome
                if isinstance(outcome, ErrorMarker):
                    failure = RoundRefused if outcome.refused else RoundFailed
                    raise failure(f"round {round_} of job {job}: {outcome.message}")
                self._check_running()
                await asyncio.sleep(self._config.poll_interval_s)

    def _submit(self, instruction: RoundInstruction) -> None:
        # The new instruction first: until the old error is gone the round reads as
        # answered, so the workers never serve the old content in between.
        self.handoff.write_instruction(instruction)
        self.handoff.clear_error(instruction.job, instruction.round)

    def _outcome(self, job: str, round_: int) -> RoundResult | ErrorMarker | None:
        result = self.handoff.read_completed(job, round_)
        if result is not None:
            return result
        return self.handoff.read_error_marker(job, round_)

    async def _supervise(self) -> None:
        try:
            await self._watch()
        except Exception as exc:
            # Unsupervised workers must not keep an agent waiting for a round.
            log.exception("worker group supervisor failed")
            self._failure = WorkerGroupFailed(f"worker group supervisor failed: {exc!r}")
            await self._launcher_call(self._launcher.kill)

    async def _watch(self) -> None:
        seen_restarts = await asyncio.to_thread(lambda: self._launcher.restart_count)
        while True:
            await asyncio.sleep(self._config.poll_interval_s)
            status = self._launcher.poll()
            if status is None:
                restarts = await asyncio.to_thread(lambda: self._launcher.restart_count)
                if restarts > seen_restarts:
                    seen_restarts = restarts
                    tails = await asyncio.to_thread(self._log_tails)
                    log.warning(
                        "worker group restarted by its launcher (%d so far)\n%s", restarts, tails
                    )
                continue
            tails = await asyncio.to_thread(self._log_tails)
            retry = self._retry
            retry.recovered(self._launched_at, self._config.healthy_after_s)
            if retry.failures >= self._config.max_relaunches:
                self._failure = WorkerGroupFailed(
                    f"worker group exited with status {status} after {retry.failures} "
                    f"consecutive relaunches (the cap); last output:\n{tails}"
                )
                log.error("%s", self._failure)
                await self._launcher_call(self._launcher.kill)
                return
            delay = retry.failed()
            log.error(
                "worker group exited with status %s; relaunching in %.1f s\n%s",
                status,
                delay,
                tails,
            )
            await retry.wait(delay)
            await self._launcher_call(self._launcher.kill)
            await self._start_launcher()
            self._relaunches += 1

    def _log_tails(self) -> str:
        paths = sorted(self.handoff.log_dir.glob("rank-*.log"))
        paths.append(self.handoff.launcher_log_path)
        parts = []
        for path in paths:
            lines = _tail(path, self._config.log_tail_lines)
            if lines:
                parts.append(f"--- {path.name} ---\n" + "\n".join(lines))
        return "\n".join(parts)


def _tail(path: Path, lines: int, max_bytes: int = 64 * 1024) -> list[str]:
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            text = f.read().decode(errors="replace")
    except OSError:  # gone, or unreadable: a tail is help, never a failure of its own
        return []
    return text.splitlines()[-lines:] if lines else []
