"""The agent's HTTP client to the coordinator: identity, timeouts, errors, resumable GETs.

:func:`build_session` makes the one ``aiohttp.ClientSession`` an agent uses. With TLS it
presents the region's certificate and talks only to a server whose certificate names a
``coordinator`` of the federation (:class:`geofed.pki.httpauth.VerifiedConnector`,
checked after the handshake, before any byte of a request). With
``insecure_loopback`` (the demo) it speaks plain HTTP and names itself in an
``X-Geofed-Identity`` header, and says so loudly.

:class:`CoordinatorClient` wraps the session: every request runs under
:func:`geofed.timeouts.wait_for`, and every failure becomes one of three errors, so
callers can decide what to retry: :class:`TransportError` (connection refused, dropped,
timed out: retry), :class:`HttpError` (the coordinator answered ``{"error", "message"}``:
its ``code`` decides) and :class:`UntrustedServer` (the server's identity was refused:
never retry).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Final, Protocol

import aiohttp
from yarl import URL

from geofed.backoff import Backoff, Retry, Sleep
from geofed.pki import CertificateRefused, client_ssl_context
from geofed.pki.httpauth import VerifiedConnector
from geofed.timeouts import Timeout, Timeouts, wait_for
from geofed.types import Role
from regional_agent.config import AgentConfig
from regional_agent.credentials import Credentials

log = logging.getLogger(__name__)

IDENTITY_HEADER: Final = "X-Geofed-Identity"
_READ_BLOCK = 1 << 16
#: Bytes of a download to a file gathered before a thread writes them.
_WRITE_BATCH = 4 << 20
#: Answers that say "not now" (a request timed out, the server or a proxy in front of it
#: failed or is overloaded); the request may be repeated, within the caller's deadline.
_TRANSIENT_STATUS = frozenset({408, 500, 502, 503, 504})


class CoordinatorError(Exception):
    """Base class of the errors talking to the coordinator."""


class TransportError(CoordinatorError):
    """The request did not get an answer (refused, dropped, timed out); retrying may help."""


class UntrustedServer(CoordinatorError):
    """The server's certificate is not an accepted coordinator of the federation."""


class HttpError(CoordinatorError):
    """The coordinator answered with an error status; ``code`` is its error code."""

    def __init__(self, status: int, code: str, message: str, what: str) -> None:
        super().__init__(f"{what}: HTTP {status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Answer:
    """A successful response: status, headers and the whole body."""

    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> dict[str, Any]:
        try:
            data = json.loads(self.body)
        except ValueError as exc:
            raise CoordinatorError(f"coordinator answered non-JSON: {exc}") from None
        if not isinstance(data, dict):
            raise CoordinatorError("coordinator answered JSON that is not an object")
        return data


def build_session(config: AgentConfig, credentials: Credentials) -> aiohttp.ClientSession:
    """The agent's client session (see the module docstring); the caller closes it."""
    timeouts = config.timeouts
    timeout = aiohttp.ClientTimeout(
        total=None,
        connect=timeouts.connect_s,
        sock_connect=timeouts.connect_s,
        sock_read=timeouts.request_s,
    )
    if config.insecure_loopback:
        log.warning(
            "INSECURE LOOPBACK MODE: talking plain HTTP to %s and claiming identity %s in "
            "an %s header; for the single-machine demo only",
            config.coordinator_url,
            credentials.identity,
            IDENTITY_HEADER,
        )
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(),
            timeout=timeout,
            headers={IDENTITY_HEADER: credentials.identity.uri},
        )
    context = client_ssl_context(credentials.bundle, credentials.cert_file, credentials.key_file)
    connector = VerifiedConnector(credentials.trust, context, expect=Role.COORDINATOR)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


class CoordinatorClient:
    """Requests to the coordinator's HTTP API, with timeouts and typed errors."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        timeouts: Timeouts,
        *,
        backoff: Backoff | None = None,
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.session = session
        self.base_url = URL(base_url)
        self.timeouts = timeouts
        self.backoff = backoff or Backoff(initial_s=0.2, max_s=10.0)
        self.sleep = sleep
        self.rng = rng or random.Random()

    def url(self, path_or_url: str) -> URL:
        """An absolute URL: ``path_or_url`` itself, or resolved against the base URL."""
        target = URL(path_or_url)
        return target if target.is_absolute() else self.base_url.join(target)

    async def request(
        self,
        method: str,
        path_or_url: str,
        *,
        data: bytes | None = None,
        json_body: object = None,
        timeout_s: float | None = None,
        what: str | None = None,
    ) -> Answer:
        """Send one request and read the whole answer within ``timeout_s`` (request_s)."""
        url = self.url(path_or_url)
        label = what or f"{method} {url.path}"
        limit = self.timeouts.request_s if timeout_s is None else timeout_s
        try:
            return await wait_for(self._send(method, url, data, json_body, label), limit, label)
        except Timeout as exc:
            raise TransportError(str(exc)) from exc

    async def _send(
        self, method: str, url: URL, data: bytes | None, json_body: object, what: str
    ) -> Answer:
        try:
            async with self.session.request(method, url, data=data, json=json_body) as response:
                body = await response.read()
                headers = dict(response.headers)
                status = response.status
        except CertificateRefused as exc:
            raise UntrustedServer(f"{what}: {url.origin()} refused: {exc}") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise TransportError(f"{what}: {type(exc).__name__}: {exc}") from exc
        if status >= 400:
            raise _http_error(status, body, what)
        return Answer(status, headers, body)

    async def download(
        self,
        path_or_url: str,
        *,
        what: str | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> bytearray:
        """GET a whole file within ``download_s``, resuming with ``Range`` after a drop;
        the body as it was received (a snapshot is as large as the model: no second copy).

        Transport failures are retried with back-off until the download deadline; an
        error answer from the coordinator (404, 403, ...) is raised at once.
        ``on_bytes(n)`` hears every block as it arrives, re-sent ones included (what
        the WAN carried, for metrics).
        """
        sink = _MemorySink()
        await self._download_into(path_or_url, sink, what, on_bytes)
        return sink.data

    async def download_to(
        self,
        path_or_url: str,
        target: Path,
        *,
        what: str | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> int:
        """:meth:`download` into the file ``target`` (created owner-only, or emptied), written
        from a thread in batches as the blocks arrive, so no model-sized body is ever in
        memory; its size. After a failure ``target`` holds part of the body (the caller
        removes it)."""
        f = await _opened(target)
        try:
            sink = _FileSink(f)
            await self._download_into(path_or_url, sink, what, on_bytes)
            await sink.flush()
            await asyncio.to_thread(f.flush)
            return sink.size
        finally:
            await asyncio.to_thread(f.close)

    async def _download_into(
        self,
        path_or_url: str,
        sink: _Sink,
        what: str | None,
        on_bytes: Callable[[int], None] | None,
    ) -> None:
        url = self.url(path_or_url)
        label = what or f"download {url.path}"
        work = self._download(url, label, sink, on_bytes or _ignore)
        try:
            await wait_for(work, self.timeouts.download_s, label)
        except Timeout as exc:
            raise TransportError(str(exc)) from exc

    async def _download(
        self, url: URL, what: str, sink: _Sink, on_bytes: Callable[[int], None]
    ) -> None:
        retry = Retry(self.backoff, rng=self.rng, sleep=self.sleep)
        while True:
            try:
                await self._fetch_into(url, sink, what, on_bytes)
            except TransportError as exc:
                delay = retry.failed()
                log.warning("%s interrupted at %d bytes (%s); resuming", what, sink.size, exc)
                await retry.wait(delay)
            else:
                return

    async def _fetch_into(
        self, url: URL, sink: _Sink, what: str, on_bytes: Callable[[int], None]
    ) -> None:
        headers = {"Range": f"bytes={sink.size}-"} if sink.size else {}
        try:
            async with self.session.get(url, headers=headers) as response:
                if response.status >= 400:
                    raise _http_error(response.status, await response.read(), what)
                if response.status != 206:
                    await sink.clear()  # a full answer: the server ignored (or had no) Range
                else:
                    _check_range(response.headers.get("Content-Range", ""), sink.size, what)
                while block := await wait_for(
                    response.content.read(_READ_BLOCK), self.timeouts.request_s, f"{what} read"
                ):
                    await sink.add(block)
                    on_bytes(len(block))
        except CertificateRefused as exc:
            raise UntrustedServer(f"{what}: {url.origin()} refused: {exc}") from exc
        except (aiohttp.ClientError, OSError, Timeout) as exc:
            raise TransportError(f"{what}: {type(exc).__name__}: {exc}") from exc


class _Sink(Protocol):
    """Where a download's body goes: its size so far (where a resumed GET starts)."""

    @property
    def size(self) -> int: ...

    async def clear(self) -> None: ...

    async def add(self, block: bytes) -> None: ...


class _MemorySink:
    def __init__(self) -> None:
        self.data = bytearray()

    @property
    def size(self) -> int:
        return len(self.data)

    async def clear(self) -> None:
        self.data.clear()

    async def add(self, block: bytes) -> None:
        self.data += block


class _FileSink:
    """Blocks appended to a file, written from a thread once ``_WRITE_BATCH`` bytes wait.

    Emptying the file for a full answer waits for the first write too: no thread hop
    comes between an answer's headers and its first blocks."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._pending = bytearray()
        self._size = 0
        self._restart = False

    @property
    def size(self) -> int:
        return self._size

    async def clear(self) -> None:
        self._pending.clear()
        self._size = 0
        self._restart = True

    async def add(self, block: bytes) -> None:
        self._pending += block
        self._size += len(block)
        if len(self._pending) >= _WRITE_BATCH:
            await self.flush()

    async def flush(self) -> None:
        if self._pending or self._restart:
            data, self._pending = self._pending, bytearray()
            restart, self._restart = self._restart, False
            await asyncio.to_thread(_write, self._f, data, restart)


def _write(f: BinaryIO, data: bytearray, restart: bool) -> None:
    if restart:
        f.seek(0)
        f.truncate()
    f.write(data)


async def _opened(path: Path) -> BinaryIO:
    """:func:`_open_private` in a thread. Cancelled while the thread opens, it still waits
    for the open (one system call) and closes the file before the cancellation goes on:
    a file opened for nobody would be left to the garbage collector."""
    opening = asyncio.ensure_future(asyncio.to_thread(_open_private, path))
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        while not opening.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(opening)
        if not opening.cancelled() and opening.exception() is None:
            opening.result().close()
        raise


def _open_private(path: Path) -> BinaryIO:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a file that was there keeps its mode through O_CREAT
    except OSError:
        os.close(fd)
        raise
    return os.fdopen(fd, "wb")


def _ignore(_count: int) -> None:
    pass


def _check_range(content_range: str, start: int, what: str) -> None:
    unit, _, spec = content_range.partition(" ")
    first = spec.partition("-")[0]
    if unit != "bytes" or not first.isdigit() or int(first) != start:
        raise TransportError(f"{what}: Content-Range {content_range!r} does not resume at {start}")


def _http_error(status: int, body: bytes, what: str) -> CoordinatorError:
    if status in _TRANSIENT_STATUS:
        return TransportError(f"{what}: HTTP {status} {body[:200].decode('utf-8', 'replace')}")
    code, message = f"http_{status}", body[:200].decode("utf-8", errors="replace")
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        code = str(data.get("error", code))
        message = str(data.get("message", message))
    return HttpError(status, code, message, what)
