"""Child processes of the demo: started in their own session, logged to files, always reaped.

Each daemon runs as ``python -m geofed_cli ...`` in a new session so that stopping it also
stops whatever it started (a regional agent's worker group); with a fork server
(:mod:`geofed_cli.demo.fork_client`) it runs the same command in a child forked from a
process that imported the daemons once. Stopping sends SIGTERM to the
whole process group and SIGKILL after a deadline, so the demo never leaves orphans behind.

Supervised (``ChildSet(..., supervise=RestartPolicy())``), a child that exits is restarted
as the shipped systemd units would (:mod:`geofed_cli.demo.supervisor`): its process group
is swept, it waits out the back-off and starts again with the same arguments and log file;
each step is reported through ``on_event``. Only a child that will not be restarted (a
clean or configuration exit, or past the start limit) makes :meth:`ChildSet.check_alive`
raise. Unsupervised, any exit does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from geofed.parent_death import die_with_parent
from geofed_cli.demo.fork_client import ForkedProcess, ForkServer
from geofed_cli.demo.supervisor import RestartPolicy

log = logging.getLogger(__name__)


class ChildFailed(RuntimeError):
    """A child process exited while the demo still needed it."""


class Child:
    """One daemon process of the demo."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        log_file: Path,
        env: dict[str, str],
        group: str | None = None,
        fork_server: ForkServer | None = None,
    ) -> None:
        self.name = name
        self.group = group
        self.args = list(args)
        self.log_file = log_file
        self.env = env
        self.fork_server = fork_server
        self._proc: asyncio.subprocess.Process | ForkedProcess | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.returncode

    async def start(self) -> None:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        if self.fork_server is not None:
            self._proc = await asyncio.to_thread(
                self.fork_server.spawn,
                self.args,
                env=self.env,
                cwd=Path.cwd(),
                log_file=self.log_file,
            )
            log.debug("forked %s (pid %d): %s", self.name, self._proc.pid, " ".join(self.args))
            return
        with self.log_file.open("ab") as out:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "geofed_cli",
                *self.args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                # Killed with the demo, even by SIGKILL: no daemon outlives it.
                preexec_fn=die_with_parent(os.getpid()),
            )
        log.debug("started %s (pid %d): %s", self.name, self._proc.pid, " ".join(self.args))

    async def wait(self) -> int:
        """Until the current process exits; its return code."""
        assert self._proc is not None, "not started"
        return await self._proc.wait()

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        """Raise :class:`ChildFailed` with the tail of its log if the process has exited."""
        if self._proc is not None and self._proc.returncode is not None:
            raise ChildFailed(
                f"{self.name} exited with code {self._proc.returncode}; "
                f"last lines of {self.log_file}:\n{self.log_tail()}"
            )

    async def stop(self, deadline_s: float) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``deadline_s``; return the exit code."""
        proc = self._proc
        if proc is None:
            return None
        if proc.returncode is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(deadline_s):
                    await proc.wait()
            except TimeoutError:
                log.warning("%s did not stop within %.0f s; killing it", self.name, deadline_s)
        # The leader may be gone while workers it started still run: kill the group anyway.
        _signal_group(proc.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):
                await proc.wait()
        return proc.returncode


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_waves(children: Sequence[Child]) -> list[list[Child]]:
    """The order in which ``children`` (as started) stop: the last started first, one
    after another, but a group's children together, where its last started one stands."""
    waves: list[list[Child]] = []
    placed: set[int] = set()
    for child in reversed(children):
        if id(child) in placed:
            continue
        wave = [child]
        if child.group is not None:
            wave = [c for c in reversed(children) if c.group == child.group]
        placed.update(id(c) for c in wave)
        waves.append(wave)
    return waves


class ChildSet:
    """The demo's children; leaving the context stops them all, the last started first.

    Children started in one ``group`` (the regions' agents) stop together, at once, where
    the group's last started one would stop: none of them waits for another.
    """

    def __init__(
        self,
        log_dir: Path,
        *,
        stop_deadline_s: float = 20.0,
        supervise: RestartPolicy | None = None,
        on_event: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        fork_server: ForkServer | None = None,
    ) -> None:
        """``supervise``: restart children that exit (see the module docstring);
        ``on_event(line)`` hears of each exit and restart; ``fork_server``: fork the
        children from it (:mod:`geofed_cli.demo.fork_client`) rather than start each
        as a new interpreter."""
        self.log_dir = log_dir
        self.fork_server = fork_server
        self.stop_deadline_s = stop_deadline_s
        self.children: list[Child] = []
        self.env = dict(os.environ)
        # Each process is single-threaded: 2 cores are shared by about ten of them.
        self.env.setdefault("OMP_NUM_THREADS", "1")
        self._policy = supervise
        self._on_event = on_event or (lambda line: log.warning("%s", line))
        self._clock = clock
        self._watchers: list[asyncio.Task[None]] = []
        #: Child name -> when it was restarted (``clock`` readings).
        self.restarted: dict[str, list[float]] = {}
        #: Child name -> why supervision gave it up.
        self._given_up: dict[str, str] = {}
        self._stopping = False

    async def start(self, name: str, args: Sequence[str], *, group: str | None = None) -> Child:
        child = Child(name, args, self.log_dir / f"{name}.log", self.env, group, self.fork_server)
        self.children.append(child)
        await child.start()
        if self._policy is not None:
            self._watchers.append(asyncio.create_task(self._supervise(child, self._policy)))
        return child

    def restarts(self) -> dict[str, int]:
        """Child name -> how many times it was restarted (supervised only)."""
        return {name: len(times) for name, times in self.restarted.items() if times}

    def check_alive(self) -> None:
        if self._policy is None:
            for child in self.children:
                child.check_alive()
            return
        for child in self.children:
            reason = self._given_up.get(child.name)
            if reason is not None:
                raise ChildFailed(
                    f"{child.name} {reason}; last lines of {child.log_file}:\n{child.log_tail()}"
                )

    async def _supervise(self, child: Child, policy: RestartPolicy) -> None:
        times = self.restarted.setdefault(child.name, [])
        while True:
            code = await child.wait()
            if self._stopping:
                return
            decision = policy.decide(code, times, self._clock())
            self._on_event(f"{child.name} {decision.reason}")
            if not decision.restart:
                self._given_up[child.name] = decision.reason
                return
            # Whatever the dead process left in its session (a worker group) goes first.
            await child.stop(0.0)
            await asyncio.sleep(decision.delay_s)
            starting = asyncio.ensure_future(child.start())
            try:
                await asyncio.shield(starting)
            except asyncio.CancelledError:
                await starting  # started all the same, so that stop_all() stops it
                raise
            times.append(self._clock())
            self._on_event(f"{child.name} restarted (pid {child.pid})")

    async def stop_all(self) -> dict[str, int | None]:
        # Supervision first: a child stopped from here on is not restarted.
        self._stopping = True
        for watcher in self._watchers:
            watcher.cancel()
        if self._watchers:
            await asyncio.wait(self._watchers)
        codes: dict[str, int | None] = {}
        for wave in stop_waves(self.children):
            stopped = await asyncio.gather(*(c.stop(self.stop_deadline_s) for c in wave))
            codes.update(zip((c.name for c in wave), stopped, strict=True))
        return codes

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Shielded: a Ctrl-C during shutdown must not leave children running.
        await asyncio.shield(self.stop_all())
