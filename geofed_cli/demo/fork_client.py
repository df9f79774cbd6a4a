"""Daemons started by a fork server (:mod:`geofed_cli.demo.fork_server`), from any event loop.

A :class:`ForkServer` starts the server process once and asks it for children; each is a
:class:`ForkedProcess` with what the demo uses of an ``asyncio.subprocess.Process``: its
pid (the leader of its own session), its return code, ``wait()`` and signals. A thread reads the
server's answers, so one server serves the event loops of many runs in turn (a test
suite's), and a blocking call (starting, spawning, closing) is for a worker thread of
the caller's loop. If the server dies, its children die with it (the kernel sends them
SIGTERM) and each reads as ended by SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Final

from geofed.parent_death import die_with_parent

__all__ = ["DAEMON_MODULES", "ForkServer", "ForkServerError", "ForkedProcess"]

#: What a server imports before it forks: the command line and the daemons ``geofed
#: coordinator`` and ``geofed agent`` run (torch with them).
DAEMON_MODULES: Final = ("geofed_cli", "coordinator.daemon", "regional_agent.daemon")


class ForkServerError(RuntimeError):
    """The fork server did not start, refused a request, or is gone."""


class ForkedProcess:
    """A child of the fork server (see the module docstring)."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid = pid
        self._server = server

    @property
    def returncode(self) -> int | None:
        return self._server.returncode(self.pid)

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the process, unless it has ended."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    async def wait(self) -> int:
        """Until the process ends; its return code (``-N`` for signal N)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        self._server.watch(self.pid, loop, future)
        return await future


class ForkServer:
    """One fork server process and the thread that reads its answers."""

    def __init__(
        self, log_file: Path, env: Mapping[str, str], preload: Sequence[str] = DAEMON_MODULES
    ) -> None:
        self.log_file = log_file
        self.env = dict(env)
        self.preload = tuple(preload)
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._answered = threading.Condition(self._lock)
        self._ready = False
        self._gone = False
        self._next_id = 0
        self._answers: dict[int, dict[str, Any]] = {}
        self._codes: dict[int, int] = {}
        self._live: set[int] = set()
        self._waiters: dict[int, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[int]]]] = {}
        self._reader: threading.Thread | None = None

    def start(self, timeout_s: float = 120.0) -> None:
        """Start the server and wait until its imports are done (blocking)."""
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        # The reader thread starts the server: the kernel's parent-death signal follows
        # the thread that started a process, and this one lives exactly as long as it.
        self._reader = threading.Thread(target=self._serve, name="fork-server", daemon=True)
        self._reader.start()
        with self._answered:
            started = self._answered.wait_for(lambda: self._ready or self._gone, timeout_s)
            gone = self._gone
        if not started:
            self.close()
            raise ForkServerError(f"the fork server did not start in {timeout_s:.0f} s")
        if gone:
            raise ForkServerError(f"the fork server exited; see {self.log_file}")

    def spawn(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path,
        log_file: Path,
        stderr_file: Path | None = None,
        timeout_s: float = 30.0,
    ) -> ForkedProcess:
        """``geofed ARGS`` in a forked child (blocking until it runs), its output appended to
        ``log_file`` (its standard error to ``stderr_file`` if given)."""
        proc = self._proc
        if proc is None or proc.stdin is None:
            raise ForkServerError("the fork server is not started")
        with self._answered:
            if self._gone:
                raise ForkServerError("the fork server is gone")
            ident = self._next_id
            self._next_id += 1
        request = {"id": ident, "args": list(args), "env": dict(env), "cwd": str(cwd)}
        request["log"] = str(log_file)
        if stderr_file is not None:
            request["stderr"] = str(stderr_file)
        # Not under the state's lock: the reader thread takes it to drain the server's
        # answers, and a server blocked on a full pipe of answers reads no request.
        with self._write_lock:
            try:
                proc.stdin.write((json.dumps(request) + "\n").encode())
                proc.stdin.flush()
            except OSError as exc:
                raise ForkServerError(f"the fork server is gone: {exc}") from exc
        with self._answered:
            if not self._answered.wait_for(lambda: ident in self._answers or self._gone, timeout_s):
                raise ForkServerError(f"the fork server did not answer in {timeout_s:.0f} s")
            answer = self._answers.pop(ident, None)
        if answer is None:
            raise ForkServerError("the fork server is gone")
        if "error" in answer:
            raise ForkServerError(f"the fork server refused: {answer['error']}")
        return ForkedProcess(int(answer["pid"]), self)

    def returncode(self, pid: int) -> int | None:
        with self._lock:
            return self._codes.get(pid)

    def watch(self, pid: int, loop: asyncio.AbstractEventLoop, future: asyncio.Future[int]) -> None:
        """Resolve ``future`` (on ``loop``, the caller's) with ``pid``'s code when it ends."""
        with self._lock:
            code = self._codes.get(pid)
            if code is None:
                self._waiters.setdefault(pid, []).append((loop, future))
                return
        future.set_result(code)

    def close(self, timeout_s: float = 20.0) -> None:
        """Stop the server (it stops its children first); blocking."""
        proc = self._proc
        if proc is None:
            return
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self._reader is not None:
            self._reader.join(timeout_s)

    def _serve(self) -> None:
        try:
            with self.log_file.open("ab") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "geofed_cli.demo.fork_server", *self.preload],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env=self.env,
                    start_new_session=True,
                    # Dies with this thread, even when the process is killed by SIGKILL.
                    preexec_fn=die_with_parent(os.getpid()),
                )
        except OSError as exc:
            with self._answered:
                self._gone = True
                self._answered.notify_all()
            log_error = f"the fork server could not start: {exc}\n"
            with contextlib.suppress(OSError), self.log_file.open("a") as out:
                out.write(log_error)
            return
        assert self._proc.stdout is not None
        self._read(self._proc.stdout)

    def _read(self, stream: IO[bytes]) -> None:
        for line in stream:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            with self._answered:
                if "ready" in message:
                    self._ready = True
                elif "exit" in message:
                    self._ended(int(message["exit"]), int(message["code"]))
                elif "id" in message:
                    if "pid" in message:
                        self._live.add(int(message["pid"]))
                    self._answers[message["id"]] = message
                self._answered.notify_all()
        stream.close()
        with self._answered:
            self._gone = True
            # The kernel sent each child SIGTERM as the server died (PR_SET_PDEATHSIG).
            for pid in list(self._live):
                self._ended(pid, -signal.SIGTERM)
            self._answered.notify_all()

    def _ended(self, pid: int, code: int) -> None:
        # Called with the lock held.
        self._live.discard(pid)
        self._codes[pid] = code
        for loop, future in self._waiters.pop(pid, []):
            with contextlib.suppress(RuntimeError):  # a loop closed since: nobody waits
                loop.call_soon_threadsafe(_resolve, future, code)


def _resolve(future: asyncio.Future[int], code: int) -> None:
    if not future.done():
        future.set_result(code)
