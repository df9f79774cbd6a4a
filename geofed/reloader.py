"""Running a daemon's reload when SIGHUP arrives: one at a time, off the event loop.

Both daemons install :meth:`Reloader.request` as their SIGHUP handler. The reading and
checking (``prepare``: files, YAML, certificates) runs in a thread; ``apply`` puts the
result in force on the event loop and returns the report that is logged. A SIGHUP that
arrives during a reload queues one more, so the last edit is always read. Under systemd
the reload is framed by ``RELOADING=1`` and ``READY=1`` once the daemon serves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

from geofed.reload import ReloadReport
from geofed.sdnotify import Notifier

__all__ = ["Reloader"]

log = logging.getLogger(__name__)

P = TypeVar("P")


class Reloader(Generic[P]):
    """Runs ``prepare`` in a thread, then ``apply`` on the loop, and logs the report."""

    def __init__(
        self,
        prepare: Callable[[], P],
        apply: Callable[[P], ReloadReport],
        notifier: Notifier,
        what: str,
    ) -> None:
        self._prepare = prepare
        self._apply = apply
        self._notifier = notifier
        self._what = what
        self._task: asyncio.Task[None] | None = None
        self._again = False
        #: Set once the daemon is ready: a READY=1 after a reload must not precede the first.
        self.serving = False

    def request(self) -> None:
        """The SIGHUP handler."""
        log.info("received SIGHUP; reloading the %s", self._what)
        if self._task is not None and not self._task.done():
            self._again = True
            return
        self._task = asyncio.create_task(self._run(), name="reload")

    async def wait(self) -> None:
        """Until the reloads requested so far are done (tests, shutdown)."""
        if self._task is not None:
            await asyncio.wait([self._task])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])

    async def _run(self) -> None:
        self._again = True
        while self._again:
            self._again = False
            if self.serving:
                self._notifier.reloading(f"reloading the {self._what}")
            try:
                prepared = await asyncio.to_thread(self._prepare)
                report = self._apply(prepared)
            except Exception:
                log.exception("%s reload failed; nothing changed", self._what)
            else:
                report.log(log, self._what)
            finally:
                if self.serving:
                    self._notifier.ready(f"{self._what} reloaded")
