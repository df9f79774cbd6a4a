"""Child processes of the demo: started in their own session, logged to files, always reaped.

Each daemon runs as ``python -m geofed_cli ...`` in a new session so that stopping it also
stops whatever it started (a regional agent's worker group). Stopping sends SIGTERM to the
whole process group and SIGKILL after a deadline, so the demo never leaves orphans behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

log = logging.getLogger(__name__)


class ChildFailed(RuntimeError):
    """A child process exited while the demo still needed it."""


class Child:
    """One daemon process of the demo."""

    def __init__(self, name: str, args: Sequence[str], log_file: Path, env: dict[str, str]) -> None:
        self.name = name
        self.args = list(args)
        self.log_file = log_file
        self.env = env
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.returncode

    async def start(self) -> None:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
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
            )
        log.debug("started %s (pid %d): %s", self.name, self._proc.pid, " ".join(self.args))

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
                await asyncio.wait_for(proc.wait(), deadline_s)
            except TimeoutError:
                log.warning("%s did not stop within %.0f s; killing it", self.name, deadline_s)
        # The leader may be gone while workers it started still run: kill the group anyway.
        _signal_group(proc.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 5.0)
        return proc.returncode


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class ChildSet:
    """The demo's children; leaving the context stops them all (last started, first stopped)."""

    def __init__(self, log_dir: Path, *, stop_deadline_s: float = 20.0) -> None:
        self.log_dir = log_dir
        self.stop_deadline_s = stop_deadline_s
        self.children: list[Child] = []
        self.env = dict(os.environ)
        # Each process is single-threaded: 2 cores are shared by about ten of them.
        self.env.setdefault("OMP_NUM_THREADS", "1")

    async def start(self, name: str, args: Sequence[str]) -> Child:
        child = Child(name, args, self.log_dir / f"{name}.log", self.env)
        self.children.append(child)
        await child.start()
        return child

    def check_alive(self) -> None:
        for child in self.children:
            child.check_alive()

    async def stop_all(self) -> dict[str, int | None]:
        codes: dict[str, int | None] = {}
        for child in reversed(self.children):
            codes[child.name] = await child.stop(self.stop_deadline_s)
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
