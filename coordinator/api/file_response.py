"""A file sent in answer to a request, within a time limit, optionally counted.

aiohttp prepares a response a handler returns; a handler must not prepare it itself as
well (it would be prepared twice, and aiohttp logs an ``AssertionError``). The time
limit therefore lives in :meth:`BoundedFile.prepare`: a client that stops reading would
otherwise hold the connection forever.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from geofed.timeouts import wait_for

__all__ = ["BoundedFile"]


class BoundedFile(web.FileResponse):
    """A file response (``Range`` included) sent within ``timeout_s``; ``on_sent`` is told
    the status and the bytes sent once the answer is under way."""

    def __init__(
        self,
        path: Path,
        timeout_s: float,
        headers: dict[str, str],
        on_sent: Callable[[int, int], None] | None = None,
    ) -> None:
        super().__init__(path, headers=headers)
        self._on_sent = on_sent
        self._timeout_s = timeout_s

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        writer = await wait_for(
            super().prepare(request), self._timeout_s, f"sending {request.path}"
        )
        if self._on_sent is not None:
            self._on_sent(self.status, self.content_length or 0)
        return writer
