"""The control client against the embedded amqtt broker, over real loopback sockets."""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import signal
import subprocess
import sys
import warnings
from collections.abc import AsyncIterator
from typing import Any

import pytest

from geofed.backoff import Backoff
from geofed.control import (
    Command,
    ControlClient,
    ControlError,
    ControlTimeout,
    NotRunning,
    Publication,
    RegionStatus,
    RoundAnnouncement,
    SubscriptionRefused,
    decode,
    encode,
)
from geofed.control.broker import EmbeddedBroker
from tests.support.control import (
    KEEPALIVE_S,
    SLACK_S,
    TOPICS,
    Inbox,
    RecordingSleep,
    reap,
    running,
    start_agent,
)
from tests.support.control_messages import announcement
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration


def make_client(port: int, client_id: str, **kwargs: Any) -> ControlClient:
    kwargs.setdefault("timeout_s", 5.0)
    return ControlClient("127.0.0.1", port, client_id=client_id, **kwargs)


@pytest.fixture
async def broker() -> AsyncIterator[EmbeddedBroker]:
    async with EmbeddedBroker(port=0) as embedded:
        yield embedded


async def test_publish_subscribe_round_trip(broker: EmbeddedBroker) -> None:
    inbox = Inbox()
    agent = make_client(broker.port, "agent-eu-west")
    await agent.subscribe(TOPICS.all_job_rounds(), inbox)
    async with running(agent), running(make_client(broker.port, "coordinator")) as coordinator:
        sent = announcement()
        await coordinator.publish(TOPICS.job_round(sent.job), encode(sent))
        topic, payload = await inbox.get()
    assert topic == TOPICS.job_round("llm-7")
    assert decode(payload, RoundAnnouncement) == sent
    assert broker.url == f"mqtt://127.0.0.1:{broker.port}"


async def test_retained_announcement_reaches_a_late_subscriber(broker: EmbeddedBroker) -> None:
    sent = announcement()
    async with running(make_client(broker.port, "coordinator")) as coordinator:
        await coordinator.publish(TOPICS.job_round(sent.job), encode(sent), retain=True)
    inbox = Inbox()
    late = make_client(broker.port, "late-agent")
    await late.subscribe(TOPICS.all_job_rounds(), inbox)
    async with running(late):
        _, payload = await inbox.get()
    assert decode(payload, RoundAnnouncement) == sent


async def test_subscribing_while_connected_takes_effect_at_once(broker: EmbeddedBroker) -> None:
    inbox = Inbox()
    async with running(make_client(broker.port, "watcher")) as watcher:
        await watcher.subscribe(TOPICS.events(), inbox)
        await watcher.publish(TOPICS.events(), b"{}")
        assert await inbox.get() == (TOPICS.events(), b"{}")


async def test_a_failing_handler_does_not_stop_delivery(broker: EmbeddedBroker) -> None:
    inbox = Inbox()
    calls = 0

    async def broken(topic: str, payload: bytes) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("handler bug")

    client = make_client(broker.port, "fragile")
    # Same filter: one subscription, two handlers, called in registration order.
    await client.subscribe(TOPICS.events(), broken)
    await client.subscribe(TOPICS.events(), inbox)
    async with running(client):
        for n in range(2):
            await client.publish(TOPICS.events(), b"%d" % n)
        assert (await inbox.get())[1] == b"0"
        assert (await inbox.get())[1] == b"1"
    assert calls == 2


async def test_last_will_marks_a_killed_agent_offline(broker: EmbeddedBroker) -> None:
    child = await start_agent(broker.port)
    try:
        inbox = Inbox()
        watcher = make_client(broker.port, "watcher")
        await watcher.subscribe(TOPICS.all_region_status(), inbox)
        async with running(watcher):
            _, payload = await inbox.get()
            assert decode(payload, RegionStatus).state == "online"
            child.send_signal(signal.SIGKILL)
            _, payload = await inbox.get(timeout_s=KEEPALIVE_S * 1.5 + SLACK_S)
        status = decode(payload, RegionStatus)
        assert (status.region, status.state) == ("eu-west", "offline")
        # The will was retained: a subscriber arriving now still learns the agent is gone.
        late_inbox = Inbox()
        late = make_client(broker.port, "late-watcher")
        await late.subscribe(TOPICS.region_status("eu-west"), late_inbox)
        async with running(late):
            assert decode((await late_inbox.get())[1], RegionStatus).state == "offline"
    finally:
        reap(child)


async def test_clean_close_sends_goodbye_not_the_will(broker: EmbeddedBroker) -> None:
    topic = TOPICS.region_status("eu-west")

    def status(state: Any) -> bytes:
        return encode(RegionStatus(region="eu-west", state=state, agent_version="t"))

    inbox = Inbox()
    watcher = make_client(broker.port, "watcher")
    await watcher.subscribe(topic, inbox)
    async with running(watcher):
        agent = make_client(broker.port, "agent", will=Publication(topic, status("error")))
        task = asyncio.create_task(agent.run())
        await agent.publish(topic, status("online"), retain=True)
        await agent.close(Publication(topic, status("offline")))
        await asyncio.wait_for(task, 5)
        states = [decode((await inbox.get())[1], RegionStatus).state for _ in range(2)]
        assert states == ["online", "offline"]
        # No later event can prove the broker will never send the Will; on loopback, with
        # the broker in this event loop, it handles the DISCONNECT within milliseconds, so
        # 0.3 s bounds the wait for a wrongly published one.
        await asyncio.sleep(0.3)
        assert inbox.queue.empty(), "the Last Will was published after a clean close"
    with pytest.raises(NotRunning):
        await agent.publish(topic, b"x", timeout_s=1)


async def test_reconnects_after_broker_restart_and_resubscribes() -> None:
    first = EmbeddedBroker(port=0)
    await first.start()
    port = first.port
    policy = Backoff(initial_s=0.1, max_s=1.0, jitter=0.5, reset_after_s=5.0)
    sleep, now = RecordingSleep(), [0.0]
    agent = make_client(
        port, "agent", sleep=sleep, backoff=policy, rng=random.Random(7), clock=lambda: now[0]
    )
    commands = Inbox()
    await agent.subscribe(TOPICS.region_commands("eu-west"), commands)
    hook_runs = 0

    async def announce_online() -> None:
        nonlocal hook_runs
        hook_runs += 1
        online = RegionStatus(region="eu-west", state="online", agent_version="t")
        await agent.publish(TOPICS.region_status("eu-west"), encode(online), retain=True)

    agent.on_connect(announce_online)
    task = asyncio.create_task(agent.run())
    second: EmbeddedBroker | None = None
    try:
        await agent.wait_connected(5)
        assert agent.reconnects == 0
        await first.stop()
        await eventually(lambda: not agent.connected.is_set() and agent.connect_failures >= 2)
        second = EmbeddedBroker(port=port)
        await second.start()
        await agent.wait_connected(10)
        assert agent.reconnects == 1
        # The delays are exactly the policy's, drawn from the injected random source.
        replay = random.Random(7)
        outage = len(sleep.delays)
        assert outage >= 3
        assert sleep.delays == [policy.delay(n, replay) for n in range(outage)]
        assert sleep.delays[2] > sleep.delays[0]

        # Subscriptions came back, and the on-connect hook re-published the status that
        # the restarted broker had lost.
        statuses = Inbox()
        coordinator = make_client(port, "coordinator")
        await coordinator.subscribe(TOPICS.region_status("eu-west"), statuses)
        async with running(coordinator):
            assert decode((await statuses.get())[1], RegionStatus).state == "online"
            command = Command(action="pause", job="llm-7")
            await coordinator.publish(TOPICS.region_commands("eu-west"), encode(command))
            assert decode((await commands.get())[1], Command) == command
        assert hook_runs == 2

        # A link that stayed up past reset_after_s starts the back-off from the beginning.
        now[0] = 100.0
        await second.stop()
        await eventually(lambda: len(sleep.delays) > outage)
        assert sleep.delays[outage] == policy.delay(0, replay)
    finally:
        await agent.close(timeout_s=5)
        await asyncio.wait_for(task, 5)
        await first.stop()
        if second is not None:
            await second.stop()


async def test_publish_waits_for_the_broker_to_come_back() -> None:
    broker = EmbeddedBroker(port=0)
    await broker.start()
    port = broker.port
    agent = make_client(port, "agent", sleep=RecordingSleep(), backoff=Backoff(initial_s=0.05))
    task = asyncio.create_task(agent.run())
    try:
        await agent.wait_connected(5)
        await broker.stop()
        await eventually(lambda: not agent.connected.is_set())
        publishing = asyncio.create_task(agent.publish(TOPICS.events(), b"late", timeout_s=10))
        # Two more refused reconnection attempts while the publication waits: it outlives
        # the outage instead of failing at once.
        failures = agent.connect_failures
        await eventually(lambda: agent.connect_failures >= failures + 2)
        assert not publishing.done()
        broker = EmbeddedBroker(port=port)
        await broker.start()
        await asyncio.wait_for(publishing, 10)
    finally:
        await agent.close(timeout_s=5)
        await asyncio.wait_for(task, 5)
        await broker.stop()


async def test_publish_times_out_without_a_broker() -> None:
    sleep = RecordingSleep()
    # Port 1 on loopback: nothing listens there, so every attempt is refused.
    client = make_client(1, "lonely", sleep=sleep, backoff=Backoff(initial_s=0.05))
    task = asyncio.create_task(client.run())
    try:
        with pytest.raises(ControlTimeout, match=r"not acknowledged within 0\.5 s"):
            await client.publish(TOPICS.events(), b"x", timeout_s=0.5)
        assert client.connect_failures >= 1
    finally:
        await client.close(timeout_s=5)
        await asyncio.wait_for(task, 5)


async def test_the_broker_closes_connections_that_never_sent_connect() -> None:
    broker = EmbeddedBroker(port=0)
    await broker.start()
    try:
        # One that goes away before its CONNECT (a client killed while connecting) ...
        _, gone = await asyncio.open_connection("127.0.0.1", broker.port)
        gone.close()
        await gone.wait_closed()
        # ... and one still silent when the broker stops.
        reader, writer = await asyncio.open_connection("127.0.0.1", broker.port)
    finally:
        await broker.stop()
    try:
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the broker
    finally:
        writer.close()
        await writer.wait_closed()
    # A server-side socket left open would warn now, failing this test, not a later one.
    gc.collect()


async def test_a_connection_cancelled_at_shutdown_ends_without_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # amqtt cancels the handling of connected clients when it shuts down. asyncio's
    # server reports a handler task that ended cancelled as "Exception in callback" with a
    # traceback (seen at the end of every demo); the broker's handler ends quietly.
    broker = EmbeddedBroker(port=0)
    serving = asyncio.Event()

    async def amqtt_serves(*_: object, **__: object) -> None:
        serving.set()
        await asyncio.Event().wait()  # until cancelled, as amqtt's shutdown does

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await broker._serve(amqtt_serves, reader, writer, "default")

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await asyncio.wait_for(serving.wait(), 5)
        (handler,) = broker._connections
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            handler.cancel()
            await asyncio.wait([handler], timeout=5)
            await asyncio.sleep(0.05)  # the server's done-callback runs after the task
        assert handler.done()
        assert not handler.cancelled()
        assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
        assert await asyncio.wait_for(reader.read(), 5) == b""  # and the socket is closed
    finally:
        writer.close()
        await writer.wait_closed()
        server.close()
        await server.wait_closed()


async def test_stop_is_bounded_when_amqtt_shutdown_hangs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Seen on a loaded machine: amqtt's shutdown never finished, and stopping raised, so
    # a broker restart failed. Here its shutdown is replaced by one that never ends (a
    # fake of the third-party library, the outer edge): stop still returns within its
    # timeout, the connected client is disconnected and the port can be bound again.
    broker = EmbeddedBroker(port=0, timeout_s=1.0)
    await broker.start()
    port = broker.port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(bytes.fromhex("101000044d5154540402003c000461626364"))  # CONNECT "abcd"
    await writer.drain()
    assert (await asyncio.wait_for(reader.readexactly(4), 5))[0] == 0x20  # CONNACK

    async def hangs() -> None:
        await asyncio.Event().wait()

    broker._broker.shutdown = hangs
    loop = asyncio.get_running_loop()
    started = loop.time()
    with caplog.at_level(logging.WARNING, logger="geofed.control.broker"):
        await broker.stop()
    assert loop.time() - started < 4.0
    assert "did not finish" in caplog.text
    assert not broker.running
    try:
        assert await asyncio.wait_for(reader.read(), 5) == b""  # disconnected
    finally:
        writer.close()
        await writer.wait_closed()
    async with EmbeddedBroker(port=port) as again:  # the listener is gone
        assert again.port == port


async def test_a_stopping_broker_accepts_no_connection() -> None:
    # Seen in a fault test: amqtt disconnects its clients one after another and closes its
    # listener last, so an agent it let go first connected again before the broker was
    # gone. A connection tried while the broker stops is refused.
    broker = EmbeddedBroker(port=0)
    await broker.start()
    port = broker.port
    client = make_client(port, "region.eu-west")
    task = asyncio.create_task(client.run())
    try:
        await client.wait_connected(5)
        stopping = asyncio.create_task(broker.stop())
        await asyncio.sleep(0)  # the stop has begun; the client is still connected
        assert not stopping.done()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)
        await stopping
    finally:
        await client.close(timeout_s=5)
        await asyncio.wait_for(task, 5)


def test_standalone_broker_process_serves_and_stops_on_sigterm() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "geofed.control.broker", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        url = process.stdout.readline().decode().strip()
        assert url.startswith("mqtt://127.0.0.1:")
        port = int(url.rsplit(":", 1)[1])

        async def round_trip() -> bytes:
            inbox = Inbox()
            client = make_client(port, "probe")
            await client.subscribe(TOPICS.events(), inbox)
            async with running(client):
                await client.publish(TOPICS.events(), b"ping")
                return (await inbox.get())[1]

        assert asyncio.run(round_trip()) == b"ping"
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=15)
        assert process.returncode == 0
        assert b"UNAUTHENTICATED PLAIN TEXT" in stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=10)


@pytest.fixture
async def strict_broker() -> AsyncIterator[int]:
    """A bare amqtt broker whose ACL allows subscribing to the events topic only."""
    from amqtt.broker import Broker

    config = {
        "listeners": {"default": {"type": "tcp", "bind": "127.0.0.1:0"}},
        "plugins": {
            "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
            "amqtt.plugins.topic_checking.TopicAccessControlListPlugin": {
                "acl": {"anonymous": [TOPICS.events()]}
            },
        },
    }
    with warnings.catch_warnings():
        # amqtt 0.12 deprecates "acl" for "subscribe-acl", but its plugin config has no
        # field for the new name yet, so the deprecated one is the only one that works.
        warnings.filterwarnings("ignore", "The 'acl' option is deprecated", DeprecationWarning)
        acl_broker = Broker(config)
    await acl_broker.start()
    try:
        yield int(acl_broker._servers["default"].instance.sockets[0].getsockname()[1])
    finally:
        await acl_broker.shutdown()


async def test_refused_live_subscription_raises_and_the_link_stays_up(strict_broker: int) -> None:
    inbox = Inbox()
    client = make_client(strict_broker, "nosy")
    await client.subscribe(TOPICS.events(), inbox)
    async with running(client):
        with pytest.raises(SubscriptionRefused, match="regions/\\+/status"):
            await client.subscribe(TOPICS.all_region_status(), inbox)
        # Still connected and still served on the subscription the broker granted.
        await client.publish(TOPICS.events(), b"still here")
        assert await inbox.get() == (TOPICS.events(), b"still here")


async def test_run_stops_when_the_broker_refuses_a_registered_subscription(
    strict_broker: int,
) -> None:
    client = make_client(strict_broker, "misconfigured")
    await client.subscribe(TOPICS.all_region_commands(), Inbox())
    with pytest.raises(SubscriptionRefused):
        await asyncio.wait_for(client.run(), 10)
    assert not client.connected.is_set()
    with pytest.raises(NotRunning):
        await client.publish(TOPICS.events(), b"x", timeout_s=5)


async def _broker_that_drops_publishes(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """A fake broker (the outer edge): it accepts the CONNECT, and closes the connection
    on the first PUBLISH, before any PUBACK."""
    try:
        while True:
            header = await reader.readexactly(1)
            length, multiplier = 0, 1
            while True:
                byte = (await reader.readexactly(1))[0]
                length += (byte & 0x7F) * multiplier
                multiplier *= 128
                if not byte & 0x80:
                    break
            await reader.readexactly(length)
            kind = header[0] & 0xF0
            if kind == 0x10:  # CONNECT: accepted
                writer.write(bytes([0x20, 0x02, 0x00, 0x00]))
                await writer.drain()
            elif kind == 0x30:  # PUBLISH: gone before the PUBACK
                break
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def test_a_publish_once_gives_up_when_the_connection_is_lost_before_its_ack() -> None:
    """The coordinator's announcements publish ``once``: a connection lost mid-publish
    ends the publish at once (they are re-sent on reconnect) instead of holding the round
    engine for the whole timeout; a plain publish waits for the next connection."""
    server = await asyncio.start_server(_broker_that_drops_publishes, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = make_client(port, "coordinator", backoff=Backoff(initial_s=0.05, max_s=0.1))
    task = asyncio.create_task(client.run())
    try:
        await client.wait_connected(5)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(ControlError, match="lost with the connection"):
            await client.publish(TOPICS.events(), b"x", timeout_s=10, once=True)
        assert loop.time() - started < 5
        await client.wait_connected(5)
        # A plain publish outlives each lost connection and ends only at its timeout (with
        # the reason of where it was then: lost again, or sent and not yet acknowledged).
        started = loop.time()
        with pytest.raises(ControlTimeout, match=r"not acknowledged within 1\.5 s"):
            await client.publish(TOPICS.events(), b"y", timeout_s=1.5)
        assert loop.time() - started >= 1.5
    finally:
        await client.close(timeout_s=5)
        await asyncio.wait_for(task, 5)
        server.close()
        await server.wait_closed()
