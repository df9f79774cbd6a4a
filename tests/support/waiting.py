"""Waiting for state that offers no event to wait on: counters, log files, proxy stats,
processes."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from pathlib import Path

#: How often :func:`eventually` looks again.
POLL_S = 0.02


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]],
    timeout_s: float = 10.0,
    poll_s: float = POLL_S,
) -> None:
    """Return once ``condition()`` is true (awaited when it is a coroutine function's, as
    a request is); TimeoutError after ``timeout_s``."""

    async def holds() -> bool:
        result = condition()
        return await result if inspect.isawaitable(result) else result

    async with asyncio.timeout(timeout_s):
        while not await holds():  # noqa: ASYNC110 - the state polled has no event
            await asyncio.sleep(poll_s)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (killed, not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"
