"""Request bodies read within limits: whole bodies, exact sizes, and the commit's metrics.

A body longer than its limit is refused (413) before it is read whole, so a client cannot
make the coordinator buffer more than the limit; one whose ``Content-Length`` declares
more is refused before any of it is read.
"""

from __future__ import annotations

import asyncio
import json
import math

from aiohttp import StreamReader

from coordinator.errors import BadRequest, TooLarge

__all__ = ["commit_metrics", "read_exactly", "read_frame", "read_limited"]

_READ = 1 << 20


def commit_metrics(body: bytes) -> dict[str, float]:
    """``{"metrics": {"train_loss": 2.5, ...}}``: finite numbers only; empty body allowed."""
    if not body.strip():
        return {}
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"commit body is not JSON: {exc}") from None
    if not isinstance(document, dict) or set(document) - {"metrics"}:
        raise BadRequest('commit body must be {"metrics": {NAME: NUMBER, ...}}')
    metrics = document.get("metrics", {})
    if not isinstance(metrics, dict) or len(metrics) > 64:
        raise BadRequest('commit "metrics" must be an object of at most 64 numbers')
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or not math.isfinite(value)
        ):
            raise BadRequest(f"commit metric {name!r} must be a finite number, got {value!r}")
        out[str(name)[:64]] = float(value)
    return out


async def read_limited(
    body: StreamReader, limit: int, what: str, declared: int | None = None
) -> bytes:
    """The whole body, refusing more than ``limit`` bytes (413) before reading them all.

    ``declared`` is the request's ``Content-Length``: a body declared longer than the limit
    is refused at once, without waiting for bytes the client may never send.
    """
    if declared is not None and declared > limit:
        raise TooLarge(f"{what} of {declared} bytes exceeds the limit of {limit} bytes")
    parts: list[bytes] = []
    total = 0
    while part := await body.read(_READ):
        total += len(part)
        if total > limit:
            raise TooLarge(f"{what} exceeds the limit of {limit} bytes")
        parts.append(part)
    return b"".join(parts)


async def read_exactly(body: StreamReader, size: int, what: str) -> bytes:
    try:
        return await body.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise BadRequest(
            f"the body ended inside the {what}: {len(exc.partial)} of {size} bytes"
        ) from None


async def read_frame(body: StreamReader, size: int) -> bytes:
    """Read a frame body of exactly ``size`` bytes; longer or shorter is a corrupt chunk."""
    parts: list[bytes] = []
    total = 0
    while total <= size:
        part = await body.read(min(_READ, size + 1 - total))
        if not part:
            break
        parts.append(part)
        total += len(part)
    if total != size:
        raise BadRequest(
            f"frame body has {'more than ' if total > size else ''}{total} bytes; the "
            f"manifest records {size}",
            "corrupt_chunk",
        )
    return b"".join(parts)
