"""A reconnecting MQTT client for the control plane, on aiomqtt 2.x.

:class:`ControlClient` keeps one connection to the broker alive for a daemon: it
reconnects with jittered exponential back-off, re-subscribes after every reconnect,
dispatches incoming messages to registered handlers, and publishes with QoS 1,
returning only once the broker acknowledged (retrying across a reconnect while the
caller's deadline allows). Errors of the MQTT library never leave this module; callers
see :class:`~geofed.control.errors.ControlError` subclasses.

The caller owns the task: ``tg.create_task(client.run())``, later ``await
client.close(goodbye)``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiomqtt
from paho.mqtt.reasoncodes import ReasonCode

from geofed.backoff import Backoff, Retry, Sleep
from geofed.control.errors import (
    ControlError,
    ControlTimeout,
    NotRunning,
    SubscriptionRefused,
    TopicError,
)

log = logging.getLogger(__name__)

Handler = Callable[[str, bytes], Awaitable[None]]
"""Receives (topic, payload) of each message whose topic matches its filter."""
ConnectHook = Callable[[], Awaitable[None]]
_QOS = 1


@dataclass(frozen=True, slots=True)
class Publication:
    """A message to publish later: the Last Will, or the goodbye sent by :meth:`close`."""

    topic: str
    payload: bytes
    retain: bool = True

    def __post_init__(self) -> None:
        _check_topic(self.topic)


def _check_topic(topic: str) -> aiomqtt.Topic:
    try:
        return aiomqtt.Topic(topic)
    except (TypeError, ValueError):
        raise TopicError(f"cannot publish to {topic!r}: not a concrete MQTT topic") from None


async def _first(*aws: Awaitable[Any], within: float | None) -> set[asyncio.Future[Any]]:
    """Wait until the first of ``aws`` finishes (or ``within`` seconds); cancel the rest.

    Every wait of this module goes through here, so none can hang: a None limit is
    only used where another awaitable in ``aws`` is bounded or is the stop signal.
    """
    futures: list[asyncio.Future[Any]] = [asyncio.ensure_future(aw) for aw in aws]
    try:
        done, _ = await asyncio.wait(futures, timeout=within, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in futures:
            if not future.done():
                future.cancel()
        await asyncio.wait(futures)
    return done


@dataclass(slots=True)
class _Link:
    """One live connection: the aiomqtt client and an event set when it ends."""

    client: aiomqtt.Client
    lost: asyncio.Event = field(default_factory=asyncio.Event)


class ControlClient:
    """One daemon's connection to the control-plane broker (see the module docstring).

    ``tls`` is a client context (built from the federation trust bundle, carrying the
    daemon's certificate); None means plain TCP, for the loopback demo only. ``will``
    is registered with the broker on every connection; given as a callable, it is
    called for each connection, so every Will the broker may publish is a message of its
    own (a receiver that drops repeats by message id still sees the second one).
    ``timeout_s`` bounds each connect, subscribe, publish and disconnect wait;
    ``handler_timeout_s`` bounds each handler call. ``sleep``, ``rng`` and ``clock``
    drive the back-off and are injected so tests run without waiting.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        client_id: str,
        tls: ssl.SSLContext | None = None,
        will: Publication | Callable[[], Publication] | None = None,
        keepalive_s: int = 30,
        timeout_s: float = 10.0,
        handler_timeout_s: float = 30.0,
        clean_session: bool = True,
        backoff: Backoff | None = None,
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not client_id or len(client_id.encode()) > 128:
            raise ValueError(f"client_id must be 1-128 bytes, got {client_id!r}")
        if keepalive_s < 1 or timeout_s <= 0 or handler_timeout_s <= 0:
            raise ValueError("keepalive_s, timeout_s and handler_timeout_s must be positive")
        self.host, self.port, self.client_id = host, port, client_id
        self._tls, self._will = tls, will
        self._keepalive_s, self._timeout_s = keepalive_s, timeout_s
        self._handler_timeout_s, self._clean_session = handler_timeout_s, clean_session
        self._retry = Retry(backoff or Backoff(), rng=rng, sleep=sleep, clock=clock)
        self._clock = clock
        self._handlers: dict[str, list[Handler]] = {}
        self._hooks: list[ConnectHook] = []
        self._hook_tasks: set[asyncio.Task[None]] = set()
        self._link: _Link | None = None
        self._task: asyncio.Task[Any] | None = None
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        #: Set while a connection is up and every subscription is in place.
        self.connected = asyncio.Event()
        #: Successful connections after the first one (for metrics).
        self.reconnects = 0
        #: Connection attempts that failed before the broker accepted them.
        self.connect_failures = 0
        self._connections = 0

    # -- registration ---------------------------------------------------------------

    async def subscribe(self, topic_filter: str, handler: Handler) -> None:
        """Call ``handler(topic, payload)`` for every message matching ``topic_filter``.

        The subscription is made now if connected and again after every reconnect.
        Handlers run one at a time, in arrival order, on the task of :meth:`run`, so
        they should be quick (hand longer work to a queue). Overlapping filters may make
        the broker deliver a message once per filter, and QoS 1 may repeat it anyway:
        handlers de-duplicate by message id. Raises :class:`TopicError` for a malformed
        filter and
        :class:`SubscriptionRefused` if the broker denies it (the handler is then
        not kept).
        """
        try:
            aiomqtt.Wildcard(topic_filter)
        except (TypeError, ValueError):
            raise TopicError(f"invalid topic filter {topic_filter!r}") from None
        handlers = self._handlers.setdefault(topic_filter, [])
        handlers.append(handler)
        link = self._link
        if len(handlers) > 1 or link is None:
            return  # already subscribed, or the next connection will subscribe
        try:
            await self._subscribe_on(link.client, topic_filter)
        except SubscriptionRefused:
            handlers.remove(handler)
            if not handlers:
                del self._handlers[topic_filter]
            raise
        except aiomqtt.MqttError as exc:
            # The connection is failing; the reconnect re-subscribes everything.
            log.debug("subscribe %s deferred to the next connection: %s", topic_filter, exc)

    def on_connect(self, hook: ConnectHook) -> None:
        """Run ``hook()`` after every (re)connection, e.g. to re-publish an online status."""
        self._hooks.append(hook)

    # -- running --------------------------------------------------------------------

    async def run(self) -> None:
        """Stay connected until :meth:`close`; reconnect with back-off when the link drops.

        Raises :class:`SubscriptionRefused` if the broker refuses a subscription while
        re-subscribing: a configuration error that retrying cannot fix.
        """
        if self._task is not None:
            raise ControlError(f"control client {self.client_id}: run() was already started")
        self._task = asyncio.current_task()
        retry = self._retry
        try:
            while not self._stopping.is_set():
                up_since, error = await self._session()
                if self._stopping.is_set():
                    break
                if up_since is None:
                    self.connect_failures += 1
                else:
                    retry.recovered(up_since)
                attempt = retry.failures
                delay = retry.failed()
                # Warn when the link goes (or first fails to come) up; repeats are routine.
                level = logging.WARNING if up_since is not None or attempt == 0 else logging.INFO
                what = "lost" if up_since is not None else "failed"
                log.log(
                    level,
                    "connection to MQTT broker %s:%d %s (%s); retrying in %.2f s",
                    self.host,
                    self.port,
                    what,
                    error,
                    delay,
                    extra={"attempt": attempt, "connect_failures": self.connect_failures},
                )
                await _first(retry.wait(delay), self._stopping.wait(), within=None)
        finally:
            # Whatever ended the loop, the client is done: publish() now fails fast.
            self._stopping.set()
            for task in self._hook_tasks:
                task.cancel()
            if self._hook_tasks:
                await asyncio.wait(self._hook_tasks)
            self._stopped.set()

    async def _session(self) -> tuple[float | None, str]:
        """Connect and serve until stopped or disconnected.

        Returns when the link came up (None if it never did) and why it ended.
        """
        up_since: float | None = None
        link: _Link | None = None
        error = "closed"
        try:
            async with self._make_client() as client:
                up_since = self._clock()
                link = _Link(client)
                await self._subscribe_all(client)
                self._went_up(link)
                await self._pump(client)
        except aiomqtt.MqttError as exc:
            error = str(exc) or type(exc).__name__
        finally:
            self.connected.clear()
            self._link = None
            if link is not None:
                link.lost.set()
        return up_since, error

    def _make_client(self) -> aiomqtt.Client:
        will = None
        if self._will is not None:
            last = self._will() if callable(self._will) else self._will
            will = aiomqtt.Will(last.topic, last.payload, qos=_QOS, retain=last.retain)
        return aiomqtt.Client(
            self.host,
            self.port,
            identifier=self.client_id,
            tls_context=self._tls,
            will=will,
            keepalive=self._keepalive_s,
            timeout=self._timeout_s,
            clean_session=self._clean_session,
        )

    async def _subscribe_all(self, client: aiomqtt.Client) -> None:
        done: set[str] = set()
        # Loop until nothing new: subscribe() may register a filter while we await here.
        while pending := [f for f in self._handlers if f not in done]:
            for topic_filter in pending:
                await self._subscribe_on(client, topic_filter)
                done.add(topic_filter)

    async def _subscribe_on(self, client: aiomqtt.Client, topic_filter: str) -> None:
        codes = await client.subscribe(topic_filter, qos=_QOS, timeout=self._timeout_s)
        for code in codes:
            failed = code.is_failure if isinstance(code, ReasonCode) else code >= 0x80
            if failed:
                raise SubscriptionRefused(f"broker refused subscription to {topic_filter!r}")

    def _went_up(self, link: _Link) -> None:
        self._connections += 1
        if self._connections > 1:
            self.reconnects += 1
        self._link = link
        self.connected.set()
        log.info("connected to %s:%d as %s", self.host, self.port, self.client_id)
        for hook in self._hooks:
            task = asyncio.create_task(self._run_hook(hook))
            self._hook_tasks.add(task)
            task.add_done_callback(self._hook_tasks.discard)

    async def _run_hook(self, hook: ConnectHook) -> None:
        try:
            async with asyncio.timeout(self._timeout_s * 3):
                await hook()
        except Exception:
            log.exception("on-connect hook %r failed", hook)

    async def _pump(self, client: aiomqtt.Client) -> None:
        messages = aiter(client.messages)
        while True:
            receive = asyncio.ensure_future(anext(messages))
            done = await _first(receive, self._stopping.wait(), within=None)
            if receive not in done:
                return
            message = receive.result()
            await self._dispatch(message.topic, bytes(message.payload))

    async def _dispatch(self, topic: aiomqtt.Topic, payload: bytes) -> None:
        for topic_filter, handlers in list(self._handlers.items()):
            if not topic.matches(topic_filter):
                continue
            for handler in list(handlers):
                try:
                    async with asyncio.timeout(self._handler_timeout_s):
                        await handler(topic.value, payload)
                except TimeoutError:
                    log.error(  # noqa: TRY400 - the timeout's traceback says nothing
                        "handler %r for %s ran past %.1f s", handler, topic, self._handler_timeout_s
                    )
                except Exception:
                    # A bad message or a handler bug must not take the connection down.
                    log.exception("handler %r failed on %s", handler, topic)

    # -- publishing and shutdown ----------------------------------------------------

    async def wait_connected(self, timeout_s: float | None = None) -> None:
        """Return once connected; :class:`ControlTimeout` after ``timeout_s``."""
        timeout = self._timeout_s if timeout_s is None else timeout_s
        done = await _first(self.connected.wait(), self._stopping.wait(), within=timeout)
        if self.connected.is_set():
            return
        if done:
            raise NotRunning(f"control client {self.client_id} is closed")
        raise ControlTimeout(f"no connection to MQTT broker {self.host}:{self.port} in {timeout} s")

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        retain: bool = False,
        timeout_s: float | None = None,
        once: bool = False,
    ) -> None:
        """Publish with QoS 1 and return once the broker acknowledged it.

        Waits for a live connection and, if the connection drops before the PUBACK,
        publishes again on the next one, all within ``timeout_s`` (default: the
        client's ``timeout_s``); receivers de-duplicate. With ``once``, a connection
        lost before the PUBACK ends the publish at once (:class:`ControlError`), for a
        sender that re-sends its latest message on reconnect and must not wait for the
        broker. Raises :class:`ControlTimeout`, or :class:`NotRunning` once closed.
        """
        _check_topic(topic)
        timeout = self._timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last_error = "no connection"
        while (remaining := deadline - loop.time()) > 0:
            try:
                await self.wait_connected(remaining)
            except ControlTimeout:
                break
            link = self._link
            if link is None:
                continue
            send = asyncio.ensure_future(
                link.client.publish(topic, payload, qos=_QOS, retain=retain, timeout=remaining)
            )
            done = await _first(send, link.lost.wait(), within=deadline - loop.time())
            if send in done:
                error = send.exception()
                if error is None:
                    return
                if not isinstance(error, aiomqtt.MqttError):
                    raise ControlError(f"cannot publish to {topic}: {error}") from error
                last_error = str(error)
                if once:
                    raise ControlError(f"publish to {topic} failed: {last_error}") from error
                # A failed send means the link is going down; wait for the next one.
                await _first(link.lost.wait(), within=max(0.0, deadline - loop.time()))
            elif done:
                last_error = "connection lost before the broker acknowledged"
                if once:
                    raise ControlError(f"publish to {topic} lost with the connection")
            else:
                last_error = "no acknowledgement from the broker"
        raise ControlTimeout(
            f"publish to {topic} not acknowledged within {timeout} s ({last_error})"
        )

    async def close(
        self, goodbye: Publication | None = None, *, timeout_s: float | None = None
    ) -> None:
        """Publish ``goodbye`` if connected, disconnect cleanly and wait for :meth:`run` to end.

        A clean disconnect does not trigger the Last Will, so daemons pass their
        ``offline`` status as ``goodbye``. Safe to call more than once.
        """
        timeout = self._timeout_s if timeout_s is None else timeout_s
        if goodbye is not None and self.connected.is_set() and not self._stopping.is_set():
            try:
                await self.publish(
                    goodbye.topic, goodbye.payload, retain=goodbye.retain, timeout_s=timeout
                )
            except ControlError as exc:
                log.warning("goodbye on %s not delivered: %s", goodbye.topic, exc)
        self._stopping.set()
        task = self._task
        if task is None or task is asyncio.current_task():
            return
        await _first(self._stopped.wait(), within=timeout)
        if not self._stopped.is_set():
            log.warning(
                "control client %s did not stop in %s s; cancelling it", self.client_id, timeout
            )
            task.cancel()
            await _first(self._stopped.wait(), within=timeout)
