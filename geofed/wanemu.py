"""A userspace WAN emulator: a TCP proxy adding latency, a bandwidth cap, seeded
connection resets and partitions between a client and its target. ``geofed demo --wan``
puts one between each region and the coordinator; the fault tests and the benchmarks
drive it directly (``tests/support/wanproxy.py`` re-exports it).

    async with WanProxy("127.0.0.1", 0, "127.0.0.1", coordinator_port, seed=7) as wan:
        wan.upstream = LinkSettings(latency_s=0.05, bandwidth_bps=2_000_000)
        ...                                   # point the agent at 127.0.0.1:wan.port
        wan.partition(); ...; wan.heal()
        wan.stats().bytes_upstream            # minus the payload size: bytes re-sent

Kernel netem is out of reach on these machines, so the WAN is emulated at the byte stream.
Each direction (upstream: client to target, downstream: target to client) has its own
:class:`LinkSettings`; they are read again for every chunk, so a test may change them
while connections are open (a chunk already paced or stamped keeps its timing).

* **Bandwidth**: a token bucket paces reads from the sender, so a capped link pushes back
  on the sender through TCP as a slow link would. ``bandwidth_bps`` is in *bytes* per
  second; the bucket holds 20 ms of traffic (at least 4 KiB) as its burst.
* **Latency**: a chunk that leaves the bucket at t is written at t + ``latency_s``. Chunks
  stay in order but their delays do not add up: in-flight data is bounded by
  ``buffer_bytes`` (like a TCP window), so throughput is capped at about
  ``buffer_bytes / latency_s``, not at one chunk per latency.
* **Resets**: when connection number i (accept order, from 0) is accepted, each direction
  draws, from an RNG seeded by (seed, i, direction), whether the connection will be reset
  and after how many bytes forwarded in that direction (uniform in ``reset_after_bytes``),
  with the ``reset_probability`` in force at that moment; see :func:`plan_reset`. Once
  that many bytes are forwarded the proxy resets both ends with RST (SO_LINGER 0).
* **Partition** (:meth:`WanProxy.partition`, or ``wan.blackhole = True``): nothing is
  forwarded in either direction, not even data already in flight; new connections are
  accepted locally and held without a connection to the target. It looks like vanished
  packets, never like a clean close: senders see their TCP buffers fill, readers see
  silence. :meth:`WanProxy.heal` resumes everything where it stopped, as TCP recovers
  from a partition shorter than its retransmission timeout: held connections then
  connect to the target and deliver what their client sent meanwhile.
  ``heal(reset_existing=True)`` instead resets every open connection, as TCP gives up
  after a long partition.

When the target is unreachable, the client's connection is reset. :meth:`WanProxy.stop`
closes every connection abruptly (no RST forced) and cancels every task it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import socket
import struct
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum, StrEnum
from types import TracebackType

from geofed.timeouts import wait_for

__all__ = [
    "Direction",
    "InvalidSettings",
    "LinkSettings",
    "TokenBucket",
    "WanProxy",
    "WanProxyError",
    "WanStats",
    "plan_reset",
]

log = logging.getLogger(__name__)

MAX_READ_BYTES = 64 * 1024
MIN_BURST_BYTES = 4 * 1024
BURST_S = 0.02
DEFAULT_BUFFER_BYTES = 4 * 1024 * 1024
CONNECT_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 2.0


class WanProxyError(Exception):
    """Base of the proxy's errors."""


class InvalidSettings(WanProxyError, ValueError):
    """A link setting or proxy argument is out of range; nothing was changed."""


class Direction(StrEnum):
    """Which way bytes flow through the proxy."""

    UPSTREAM = "upstream"  # client to target
    DOWNSTREAM = "downstream"  # target to client


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class LinkSettings:
    """How one direction of the emulated WAN behaves."""

    latency_s: float = 0.0
    """One-way delay added to every chunk, in seconds."""
    bandwidth_bps: float | None = None
    """Cap in bytes (not bits) per second; None: uncapped."""
    reset_probability: float = 0.0
    """Chance that a new connection is reset after some bytes in this direction."""
    reset_after_bytes: tuple[int, int] = (1, 65_536)
    """Inclusive range the reset point is drawn from, in bytes forwarded."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not (_is_number(self.latency_s) and math.isfinite(self.latency_s)):
            problems.append(f"latency_s must be a finite number, got {self.latency_s!r}")
        elif self.latency_s < 0:
            problems.append(f"latency_s must be >= 0, got {self.latency_s!r}")
        bandwidth = self.bandwidth_bps
        if bandwidth is not None and not (
            _is_number(bandwidth) and math.isfinite(bandwidth) and bandwidth > 0
        ):
            problems.append(
                f"bandwidth_bps must be a positive finite number or None, got {bandwidth!r}"
            )
        probability = self.reset_probability
        if not (_is_number(probability) and 0.0 <= probability <= 1.0):
            problems.append(f"reset_probability must be within [0, 1], got {probability!r}")
        window = self.reset_after_bytes
        if not (
            isinstance(window, tuple)
            and len(window) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in window)
            and 1 <= window[0] <= window[1]
        ):
            problems.append(
                f"reset_after_bytes must be a pair of integers 1 <= low <= high, got {window!r}"
            )
        if problems:
            raise InvalidSettings("; ".join(problems))

    @classmethod
    def from_mapping(
        cls, values: Mapping[str, object], base: LinkSettings | None = None
    ) -> LinkSettings:
        """``base`` (default: all defaults) with the fields named in ``values`` replaced.

        Accepts JSON-shaped values (``reset_after_bytes`` as a two-item list); unknown
        names are refused.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidSettings(
                f"unknown link setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        current = (base or cls()).to_mapping()
        merged = {**current, **values}
        window = merged["reset_after_bytes"]
        if isinstance(window, list):
            merged["reset_after_bytes"] = tuple(window)
        return cls(**merged)  # type: ignore[arg-type]  # __post_init__ checks every type

    def to_mapping(self) -> dict[str, object]:
        """The settings as JSON-shaped values."""
        return {
            "latency_s": self.latency_s,
            "bandwidth_bps": self.bandwidth_bps,
            "reset_probability": self.reset_probability,
            "reset_after_bytes": list(self.reset_after_bytes),
        }


def plan_reset(seed: int, index: int, direction: Direction, settings: LinkSettings) -> int | None:
    """After how many bytes forwarded in ``direction`` connection ``index`` is reset (None: never).

    Both draws are made whatever the probability, so with the same seed and window a
    higher probability resets a superset of the connections, at the same points.
    """
    rng = random.Random(f"wanproxy:{seed}:{index}:{direction.value}")
    draw = rng.random()
    low, high = settings.reset_after_bytes
    after = rng.randint(low, high)
    return after if draw < settings.reset_probability else None


def burst_bytes(rate_bps: float) -> float:
    """The burst a bucket of ``rate_bps`` bytes per second allows."""
    return max(float(MIN_BURST_BYTES), rate_bps * BURST_S)


def read_size(link: LinkSettings) -> int:
    """How much to read at once: at most one burst when capped, so pacing stays smooth."""
    if link.bandwidth_bps is None:
        return MAX_READ_BYTES
    return min(MAX_READ_BYTES, int(burst_bytes(link.bandwidth_bps)))


class TokenBucket:
    """A token bucket in bytes, with the clock passed in.

    :meth:`reserve` always takes the tokens, going into debt if need be, and returns how
    long the caller must wait for the debt to be repaid; so chunks of any size are paced
    at exactly ``rate_bps`` on average, with at most one burst ahead.
    """

    def __init__(self, rate_bps: float, now: float) -> None:
        self.rate_bps = rate_bps
        self.burst = burst_bytes(rate_bps)
        self._tokens = self.burst
        self._stamp = now

    def reserve(self, nbytes: int, now: float) -> float:
        """Take ``nbytes`` tokens at ``now``; the seconds to wait before sending them."""
        self._refill(now)
        self._tokens -= nbytes
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate_bps

    def set_rate(self, rate_bps: float, now: float) -> None:
        """Change the rate from ``now`` on; tokens earned so far are kept (up to the burst)."""
        self._refill(now)
        self.rate_bps = rate_bps
        self.burst = burst_bytes(rate_bps)
        self._tokens = min(self._tokens, self.burst)

    def _refill(self, now: float) -> None:
        if now > self._stamp:
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate_bps)
            self._stamp = now


@dataclass(frozen=True)
class WanStats:
    """Counters since the proxy started."""

    connections_accepted: int
    connections_open: int
    """Accepted and not yet closed, including those held by a partition."""
    connections_reset: int
    """Reset by the proxy: planned resets and ``heal(reset_existing=True)``."""
    connect_failures: int
    """Target refused or unreachable (the client was reset)."""
    bytes_upstream: int
    bytes_downstream: int

    def bytes_forwarded(self, direction: Direction) -> int:
        return self.bytes_upstream if direction is Direction.UPSTREAM else self.bytes_downstream


class _Signal(Enum):
    EOF = "eof"
    PEER_GONE = "peer-gone"


@dataclass(frozen=True)
class _Chunk:
    data: bytes
    due: float


_Item = _Chunk | _Signal


class _InFlight:
    """FIFO of one direction's chunks, bounded in bytes so a slow link pushes back."""

    def __init__(self, limit_bytes: int) -> None:
        self._limit = limit_bytes
        self._items: deque[tuple[_Item, int]] = deque()
        self._bytes = 0
        self._changed = asyncio.Condition()

    async def put(self, item: _Item, size: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self._bytes < self._limit)
            self._items.append((item, size))
            self._bytes += size
            self._changed.notify_all()

    async def get(self) -> _Item:
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self._items))
            item, size = self._items.popleft()
            self._bytes -= size
            self._changed.notify_all()
            return item


class _PeerGone(Exception):
    """One end reset or broke its connection; the other end is reset too."""


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close ``writer``'s socket with RST instead of FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # already closed: nothing left to reset
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Connection:
    """One client connection: held while partitioned, then two paced, delayed pipes."""

    def __init__(
        self,
        proxy: WanProxy,
        index: int,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        reset_at: Mapping[Direction, int | None],
    ) -> None:
        self._proxy = proxy
        self.index = index
        self._client_reader, self._client_writer = client
        self._target: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._reset_at = dict(reset_at)
        self._killed = asyncio.Event()

    def _writers(self) -> list[asyncio.StreamWriter]:
        return [self._client_writer] + ([self._target[1]] if self._target else [])

    def reset(self) -> None:
        """Reset both ends now (once) and end the connection."""
        if self._killed.is_set():
            return
        self._killed.set()
        self._proxy._counters.reset += 1
        log.debug("wanproxy: resetting connection %d", self.index)
        for writer in self._writers():
            _rst(writer)

    async def run(self) -> None:
        graceful = False
        try:
            await self._proxy._open.wait()
            if self._killed.is_set():
                return
            if not await self._connect():
                return
            graceful = await self._forward()
            if graceful:
                for writer in self._writers():
                    writer.close()
                for writer in self._writers():
                    await wait_for(writer.wait_closed(), CLOSE_TIMEOUT_S, "closing a connection")
        except OSError:  # a peer vanished while closing; TimeoutError is an OSError
            graceful = False
        finally:
            if not graceful:
                for writer in self._writers():
                    writer.transport.abort()

    async def _connect(self) -> bool:
        proxy = self._proxy
        try:
            self._target = await wait_for(
                asyncio.open_connection(proxy.target_host, proxy.target_port),
                proxy.connect_timeout_s,
                f"connecting to {proxy.target_host}:{proxy.target_port}",
            )
        except OSError as exc:  # TimeoutError is an OSError too
            proxy._counters.connect_failures += 1
            log.debug("wanproxy: connection %d cannot reach the target: %s", self.index, exc)
            _rst(self._client_writer)
            return False
        return True

    async def _forward(self) -> bool:
        """Pipe both directions until both ended (True) or the connection broke (False)."""
        assert self._target is not None
        queues = {d: _InFlight(self._proxy.buffer_bytes) for d in Direction}
        ends = {
            Direction.UPSTREAM: (self._client_reader, self._target[1]),
            Direction.DOWNSTREAM: (self._target[0], self._client_writer),
        }
        name = f"wanproxy-{self.index}"
        pumps: set[asyncio.Task[None]] = set()
        for d, (source, sink) in ends.items():
            pumps.add(asyncio.create_task(self._read(d, source, queues[d]), name=f"{name}-{d}-r"))
            pumps.add(asyncio.create_task(self._write(d, sink, queues[d]), name=f"{name}-{d}-w"))
        killed: asyncio.Task[object] = asyncio.create_task(self._killed.wait(), name=f"{name}-kill")
        try:
            pending = set(pumps)
            while pending:
                done, _ = await asyncio.wait(
                    pending | {killed}, return_when=asyncio.FIRST_COMPLETED
                )
                if killed in done:
                    return False
                for task in done:
                    pending.discard(task)
                    error = task.exception()
                    if isinstance(error, _PeerGone | OSError):
                        for writer in self._writers():
                            _rst(writer)
                        return False
                    if error is not None:
                        raise error
            return not self._killed.is_set()
        finally:
            killed.cancel()
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, killed, return_exceptions=True)

    async def _read(
        self, direction: Direction, source: asyncio.StreamReader, queue: _InFlight
    ) -> None:
        proxy = self._proxy
        loop = asyncio.get_running_loop()
        bucket: TokenBucket | None = None
        while True:
            try:
                data = await source.read(read_size(proxy.link(direction)))
            except OSError:
                await queue.put(_Signal.PEER_GONE, 0)
                return
            await proxy._open.wait()
            if not data:
                await queue.put(_Signal.EOF, 0)
                return
            link = proxy.link(direction)
            if link.bandwidth_bps is None:
                bucket = None
            else:
                now = loop.time()
                if bucket is None:
                    bucket = TokenBucket(link.bandwidth_bps, now)
                elif bucket.rate_bps != link.bandwidth_bps:
                    bucket.set_rate(link.bandwidth_bps, now)
                delay = bucket.reserve(len(data), now)
                if delay > 0:
                    await asyncio.sleep(delay)
            await queue.put(_Chunk(data, loop.time() + link.latency_s), len(data))

    async def _write(
        self, direction: Direction, sink: asyncio.StreamWriter, queue: _InFlight
    ) -> None:
        proxy = self._proxy
        loop = asyncio.get_running_loop()
        reset_at = self._reset_at[direction]
        forwarded = 0
        while True:
            item = await queue.get()
            if isinstance(item, _Chunk) and item.due > loop.time():
                await asyncio.sleep(item.due - loop.time())
            await proxy._open.wait()
            if item is _Signal.EOF:
                if sink.can_write_eof():
                    sink.write_eof()
                return
            if item is _Signal.PEER_GONE:
                raise _PeerGone(direction)
            data = item.data
            if reset_at is not None and forwarded + len(data) >= reset_at:
                head = data[: reset_at - forwarded]
                sink.write(head)
                proxy._counters.add_bytes(direction, len(head))
                self.reset()
                return
            sink.write(data)
            proxy._counters.add_bytes(direction, len(data))
            forwarded += len(data)
            await sink.drain()


@dataclass
class _Counters:
    accepted: int = 0
    reset: int = 0
    connect_failures: int = 0
    bytes_upstream: int = 0
    bytes_downstream: int = 0

    def add_bytes(self, direction: Direction, count: int) -> None:
        if direction is Direction.UPSTREAM:
            self.bytes_upstream += count
        else:
            self.bytes_downstream += count


class WanProxy:
    """An asyncio TCP proxy emulating a WAN between its listener and one target."""

    def __init__(
        self,
        listen_host: str,
        listen_port: int,
        target_host: str,
        target_port: int,
        *,
        seed: int,
        upstream: LinkSettings | None = None,
        downstream: LinkSettings | None = None,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        for what, port in (("listen_port", listen_port), ("target_port", target_port)):
            if not (isinstance(port, int) and 0 <= port <= 65535):
                raise InvalidSettings(f"{what} must be an integer in [0, 65535], got {port!r}")
        if not isinstance(seed, int):
            raise InvalidSettings(f"seed must be an integer, got {seed!r}")
        if not (isinstance(buffer_bytes, int) and buffer_bytes > 0):
            raise InvalidSettings(f"buffer_bytes must be a positive integer, got {buffer_bytes!r}")
        if not (math.isfinite(connect_timeout_s) and connect_timeout_s > 0):
            raise InvalidSettings(
                f"connect_timeout_s must be a positive number, got {connect_timeout_s!r}"
            )
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.target_host = target_host
        self.target_port = target_port
        self.seed = seed
        self.buffer_bytes = buffer_bytes
        self.connect_timeout_s = connect_timeout_s
        self._links = {
            Direction.UPSTREAM: upstream or LinkSettings(),
            Direction.DOWNSTREAM: downstream or LinkSettings(),
        }
        self._open = asyncio.Event()
        self._open.set()
        self._counters = _Counters()
        self._connections: dict[asyncio.Task[None], _Connection] = {}
        self._failures: list[BaseException] = []
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._state = "new"

    async def __aenter__(self) -> WanProxy:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> int:
        """Listen; return the bound port."""
        if self._state != "new":
            raise WanProxyError(f"a WanProxy starts once; this one is {self._state}")
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.listen_port)
        self._port = int(self._server.sockets[0].getsockname()[1])
        self._state = "running"
        return self._port

    async def stop(self) -> None:
        """Stop listening, close every connection and await every task. Idempotent."""
        if self._state != "running":
            self._state = "stopped"
            return
        self._state = "stopping"
        assert self._server is not None
        self._server.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()
        self._state = "stopped"
        if self._failures:
            raise WanProxyError(
                f"{len(self._failures)} connection handler(s) failed"
            ) from self._failures[0]

    @property
    def port(self) -> int:
        """The bound listening port."""
        if self._port is None:
            raise WanProxyError("the proxy has not been started")
        return self._port

    def link(self, direction: Direction) -> LinkSettings:
        return self._links[direction]

    def set_link(self, direction: Direction, settings: LinkSettings) -> None:
        """Replace one direction's settings; open connections follow from their next chunk."""
        if not isinstance(settings, LinkSettings):
            raise InvalidSettings(f"expected LinkSettings, got {type(settings).__name__}")
        self._links[direction] = settings

    @property
    def upstream(self) -> LinkSettings:
        return self._links[Direction.UPSTREAM]

    @upstream.setter
    def upstream(self, settings: LinkSettings) -> None:
        self.set_link(Direction.UPSTREAM, settings)

    @property
    def downstream(self) -> LinkSettings:
        return self._links[Direction.DOWNSTREAM]

    @downstream.setter
    def downstream(self, settings: LinkSettings) -> None:
        self.set_link(Direction.DOWNSTREAM, settings)

    @property
    def blackhole(self) -> bool:
        """Whether the proxy is partitioned; setting it is :meth:`partition` or :meth:`heal`."""
        return not self._open.is_set()

    @blackhole.setter
    def blackhole(self, on: bool) -> None:
        if on:
            self.partition()
        else:
            self.heal()

    def partition(self) -> None:
        """Stop forwarding anything and hold new connections, until :meth:`heal`."""
        self._open.clear()

    def heal(self, *, reset_existing: bool = False) -> None:
        """End a partition: open connections resume, or are reset if ``reset_existing``."""
        if reset_existing:
            for connection in list(self._connections.values()):
                connection.reset()
        self._open.set()

    def stats(self) -> WanStats:
        c = self._counters
        return WanStats(
            connections_accepted=c.accepted,
            connections_open=len(self._connections),
            connections_reset=c.reset,
            connect_failures=c.connect_failures,
            bytes_upstream=c.bytes_upstream,
            bytes_downstream=c.bytes_downstream,
        )

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback, not a coroutine: asyncio would otherwise start a task of its
        # own per connection, which stop() could not see before it first ran.
        if self._state != "running":
            writer.transport.abort()
            return
        index = self._counters.accepted
        self._counters.accepted += 1
        reset_at = {d: plan_reset(self.seed, index, d, self._links[d]) for d in Direction}
        connection = _Connection(self, index, (reader, writer), reset_at)
        task = asyncio.get_running_loop().create_task(connection.run(), name=f"wanproxy-{index}")
        self._connections[task] = connection
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._connections.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            error = task.exception()
            assert error is not None
            log.error("wanproxy: connection handler failed", exc_info=error)
            self._failures.append(error)
