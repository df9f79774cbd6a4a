"""Every timeout geofed uses, validated as one hierarchy, and the one helper that waits.

Timeout tuning is the most common operational pain in distributed training, and a
timeout that is shorter than the wait it encloses fails in confusing ways (an upload
cut off by a request timeout, a round deadline shorter than one upload). So the
timeouts live in one model, checked once at load against the order they nest in::

    heartbeat_s < request_s < upload_s, download_s < round_deadline_s
    connect_s <= request_s

and every network wait in the daemons goes through :func:`wait_for`, which turns an
expired wait into a :class:`Timeout` that names what was being waited for.

Both helpers here bound a wait with :func:`asyncio.timeout`, never
:func:`asyncio.wait_for`: on Python 3.11, a task cancelled just as the awaitable
``asyncio.wait_for`` wraps completes gets its result instead of the cancellation, so a
loop that waits that way runs on, and whoever cancelled it to shut down waits for ever.
:func:`wait_event` is the loop's form: wait for an event, or for time to pass.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

T = TypeVar("T")

__all__ = ["Timeout", "Timeouts", "wait_event", "wait_for"]


class Timeout(TimeoutError):
    """A network wait expired; ``what`` names the wait, ``timeout_s`` its limit."""

    def __init__(self, what: str, timeout_s: float) -> None:
        super().__init__(f"{what} timed out after {timeout_s:g} s")
        self.what = what
        self.timeout_s = timeout_s


class Timeouts(BaseModel):
    """Timeouts of one daemon, in seconds; refused at load unless they nest properly."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    connect_s: float = Field(
        default=10.0,
        gt=0,
        allow_inf_nan=False,
        description="TCP + TLS handshake to the coordinator or the broker.",
    )
    heartbeat_s: float = Field(
        default=5.0,
        gt=0,
        allow_inf_nan=False,
        description="Interval of region status heartbeats and the MQTT keep-alive.",
    )
    request_s: float = Field(
        default=30.0,
        gt=0,
        allow_inf_nan=False,
        description="One control-plane request (HTTP admin call, MQTT publish ack).",
    )
    upload_s: float = Field(
        default=300.0,
        gt=0,
        allow_inf_nan=False,
        description="One whole delta upload, all of its chunks (resumable across tries).",
    )
    download_s: float = Field(
        default=300.0,
        gt=0,
        allow_inf_nan=False,
        description="One whole global update or checkpoint download.",
    )
    round_deadline_s: float = Field(
        default=1800.0,
        gt=0,
        allow_inf_nan=False,
        description=(
            "Initial round deadline, from announcement to delta arrival (inner training "
            "plus upload); the adaptive deadline takes over once rounds have been observed."
        ),
    )

    @model_validator(mode="after")
    def _check_hierarchy(self) -> Timeouts:
        problems: list[str] = []

        def must_exceed(larger: str, smaller: str) -> None:
            big, small = getattr(self, larger), getattr(self, smaller)
            if not big > small:
                problems.append(f"{larger} ({big:g}) must be greater than {smaller} ({small:g})")

        if not self.connect_s <= self.request_s:
            problems.append(
                f"connect_s ({self.connect_s:g}) must be at most request_s ({self.request_s:g})"
            )
        must_exceed("request_s", "heartbeat_s")
        must_exceed("upload_s", "request_s")
        must_exceed("download_s", "request_s")
        must_exceed("round_deadline_s", "upload_s")
        must_exceed("round_deadline_s", "download_s")
        if problems:
            raise ValueError("inconsistent timeouts: " + "; ".join(problems))
        return self


async def wait_for(aw: Awaitable[T], timeout_s: float, what: str) -> T:
    """Await ``aw`` for at most ``timeout_s`` seconds; raise :class:`Timeout` naming ``what``.

    On expiry the awaitable is cancelled (as :func:`asyncio.timeout` does). A
    :class:`Timeout` raised by a shorter, nested wait passes through unchanged, so the
    error names the innermost wait that expired; any other ``TimeoutError`` from inside
    (a socket timeout) becomes a :class:`Timeout` for ``what``. Cancellation of the
    caller propagates as ``CancelledError``.
    """
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        if inspect.iscoroutine(aw):
            aw.close()  # it will never run; closing avoids a "never awaited" warning
        raise ValueError(
            f"timeout for {what} must be a positive number of seconds, got {timeout_s!r}"
        )
    scope = asyncio.timeout(timeout_s)
    try:
        async with scope:
            return await aw
    except TimeoutError as exc:
        if scope.expired():
            raise Timeout(what, timeout_s) from None
        if isinstance(exc, Timeout):
            raise  # a nested, shorter wait expired first; keep its name
        raise Timeout(what, timeout_s) from exc


async def wait_event(event: asyncio.Event, timeout_s: float | None) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` seconds pass (None: no limit); whether
    it is set. A cancellation that arrives as the event is set is never lost."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True
