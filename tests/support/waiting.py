"""Waiting for state that offers no event to wait on: counters, log files, proxy stats,
processes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

#: How often :func:`eventually` looks again.
POLL_S = 0.02


async def eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Return once ``condition()`` is true; TimeoutError after ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 - the state polled has no event
            await asyncio.sleep(POLL_S)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (killed, not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"
