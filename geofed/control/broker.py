"""The embedded MQTT broker of the loopback demo (amqtt, in the caller's event loop).

Unauthenticated and plain text, so it binds to loopback addresses only and says so
loudly when it starts. Production uses Mosquitto with TLS client certificates
(``deploy/mosquitto``).

amqtt 0.12 does not enforce keep-alive: a client that dies publishes its Last Will as
soon as its socket closes, but a hung client (stopped, not dead) keeps its session and
never goes ``offline`` here. Mosquitto drops it after 1.5 x keep-alive.

Nor does amqtt 0.12 close every connection it accepts: one that ends before its CONNECT
is read (a client killed while connecting, a port probe) is left open, and so is any
connection still being served when the broker shuts down. So each accepted connection
is closed here when its handling ends, and whatever is still open on :meth:`stop`.
amqtt's shutdown can also hang (its last step waits for every connection of the
listener to end, and stopping a session waits on a client that reads nothing): when it
has not finished in a moment the connections are closed here, and when it still has not
finished in ``timeout_s`` the listener too, with a warning; :meth:`stop` never hangs.

In a running loop::

    async with EmbeddedBroker(port=0) as broker:
        ...  # broker.url == "mqtt://127.0.0.1:<port>"

or as its own process: ``python -m geofed.control.broker --port N``, which prints
``mqtt://<host>:<port>`` on stdout once it listens and stops cleanly on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Self

from geofed.control.errors import BrokerError
from geofed.loopback import is_loopback

log = logging.getLogger(__name__)

_LISTENER = "default"
#: How long amqtt's own shutdown runs before the connections it still serves are closed.
_SHUTDOWN_GRACE_S = 1.0
#: amqtt logs every connection at INFO; the demo wants its own progress readable.
AMQTT_LOGGERS = ("amqtt", "transitions")


def _require_loopback(host: str) -> str:
    # A bind address, not a URL's host: an IPv6 one comes without brackets.
    if host.startswith("[") or not is_loopback(host):
        raise BrokerError(
            f"refusing to expose the unauthenticated embedded broker on {host!r}: "
            "bind it to a loopback address (127.0.0.1, ::1 or localhost)"
        )
    return host


class EmbeddedBroker:
    """An anonymous amqtt broker on a loopback address; ``port=0`` picks a free port."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, timeout_s: float = 10.0) -> None:
        if not 0 <= port <= 65535:
            raise BrokerError(f"port must be in [0, 65535], got {port}")
        self.host = _require_loopback(host)
        self.port = port
        self._timeout_s = timeout_s
        self._broker: Any = None
        # Each accepted connection's handling task, with the connection's writer.
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    @property
    def url(self) -> str:
        """``mqtt://host:port``, with the bound port once started."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"mqtt://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._broker is not None

    async def start(self) -> None:
        """Bind and serve; :class:`BrokerError` if the port is taken or amqtt fails."""
        if self._broker is not None:
            raise BrokerError("embedded broker is already running")
        # Imported here: amqtt is only needed by the demo, and its import is slow.
        from amqtt.broker import Broker
        from amqtt.errors import AMQTTError

        bind_host = f"[{self.host}]" if ":" in self.host else self.host
        config = {
            "listeners": {_LISTENER: {"type": "tcp", "bind": f"{bind_host}:{self.port}"}},
            # Plugins named explicitly: amqtt's defaults add $SYS publishing and packet
            # logging, and loading plugins from entry points is deprecated (a warning).
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}
            },
        }
        try:
            broker = Broker(config)
            # Its listener, created by start(), hands each accepted connection to this.
            broker.stream_connected = functools.partial(self._serve, broker.stream_connected)
            async with asyncio.timeout(self._timeout_s):
                await broker.start()
        except (AMQTTError, OSError, TimeoutError) as exc:
            raise BrokerError(f"embedded broker could not listen on {self.url}: {exc}") from exc
        self._broker = broker
        self.port = self._bound_port(broker)
        log.warning(
            "embedded MQTT broker listening on %s: UNAUTHENTICATED PLAIN TEXT, for "
            "single-machine use only; production uses Mosquitto with TLS client certificates",
            self.url,
        )

    def _bound_port(self, broker: Any) -> int:
        # amqtt exposes no bound address; with port 0 the kernel picked one, so read it
        # from the listening socket (amqtt 0.12 keeps it in Broker._servers).
        try:
            sockets = broker._servers[_LISTENER].instance.sockets
            return int(sockets[0].getsockname()[1])
        except (AttributeError, KeyError, IndexError, TypeError) as exc:
            if self.port:
                return self.port
            raise BrokerError("cannot read the port amqtt bound to; pass an explicit port") from exc

    async def _serve(
        self,
        serve: Callable[..., Awaitable[None]],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        listener_name: str,
    ) -> None:
        """amqtt's handling of one connection, which is closed when that ends however."""
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        try:
            # Cancelled when the broker or the loop goes away. The handling then ends
            # normally rather than cancelled: asyncio's server callback reports a cancelled
            # handler as an error, and nothing awaits this task's outcome.
            with contextlib.suppress(asyncio.CancelledError):
                await serve(reader, writer, listener_name=listener_name)
        finally:
            del self._connections[task]
            writer.close()
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await writer.wait_closed()

    async def stop(self) -> None:
        """Disconnect every client and close the listener (idempotent, bounded)."""
        broker, self._broker = self._broker, None
        if broker is None:
            return
        # Accepting stops first: amqtt disconnects its clients one after another before it
        # closes its listener, and a client it let go could connect again meanwhile.
        await self._close_listeners(broker)
        shutdown = asyncio.ensure_future(broker.shutdown())
        try:
            # amqtt disconnects its clients itself, in order, when it can; a moment later
            # whatever it still serves is closed here, which is what its last step waits for.
            done, _ = await asyncio.wait(
                {shutdown}, timeout=min(_SHUTDOWN_GRACE_S, self._timeout_s)
            )
            if not done:
                await self._close_connections()
                done, _ = await asyncio.wait({shutdown}, timeout=self._timeout_s)
        finally:
            if not shutdown.done():
                shutdown.cancel()
                await asyncio.wait({shutdown})
                log.warning(
                    "embedded broker on %s: amqtt's shutdown did not finish in %.1f s; "
                    "its listener and connections were closed without it",
                    self.url,
                    self._timeout_s,
                )
            await self._close_connections()
        if not shutdown.cancelled() and shutdown.exception() is not None:
            log.warning(
                "embedded broker on %s: amqtt's shutdown failed: %r", self.url, shutdown.exception()
            )
        log.info("embedded MQTT broker on %s stopped", self.url)

    async def _close_listeners(self, broker: Any) -> None:
        # amqtt 0.12 keeps its asyncio servers in Broker._servers; closing one stops the
        # accepting at once (its wait_closed would wait for the connections, closed next).
        servers = getattr(broker, "_servers", {})
        for server in servers.values():
            with contextlib.suppress(Exception):
                server.instance.close()

    async def _close_connections(self) -> None:
        # Connections amqtt still serves after its shutdown: closed while the loop runs,
        # not left for the garbage collector (possibly after the loop is gone). Their
        # handling then reads the end of the stream and returns; cancelling it instead
        # would make asyncio 3.11 log an error from the server's done-callback.
        tasks = list(self._connections)
        for writer in self._connections.values():
            writer.close()
        if tasks:
            await asyncio.wait(tasks, timeout=self._timeout_s)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


def quiet_broker_logging(level: int = logging.WARNING) -> None:
    """Raise amqtt's loggers to ``level``; for entry points that configure logging."""
    for name in AMQTT_LOGGERS:
        logging.getLogger(name).setLevel(level)


async def serve(host: str, port: int) -> None:
    """Run an embedded broker until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with EmbeddedBroker(host, port) as broker:
        print(broker.url, flush=True)  # the parent process reads the port here
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m geofed.control.broker``; exit 0 on a clean stop, 1 if it cannot listen."""
    parser = argparse.ArgumentParser(
        prog="python -m geofed.control.broker",
        description="Embedded MQTT broker for the single-machine demo (no authentication).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="loopback address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=1883, help="TCP port; 0 picks a free one")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.log_level != "DEBUG":
        quiet_broker_logging()
    try:
        asyncio.run(serve(args.host, args.port))
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
