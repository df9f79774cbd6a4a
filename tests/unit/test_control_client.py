"""ControlClient behaviour that needs no broker: validation, lifecycle, timeouts."""

from __future__ import annotations

import asyncio

import pytest

from geofed.control import (
    ControlClient,
    ControlError,
    ControlTimeout,
    NotRunning,
    Publication,
    TopicError,
)


async def ignore(topic: str, payload: bytes) -> None:
    pass


def client(**kwargs: object) -> ControlClient:
    # Never started against a broker: port 9 (discard) on loopback is never contacted.
    return ControlClient("127.0.0.1", 9, client_id="unit", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", "a/#/b", "a/b#", "a+/b", "x" * 70000])
async def test_subscribe_refuses_malformed_filters(bad: str) -> None:
    with pytest.raises(TopicError, match="invalid topic filter"):
        await client().subscribe(bad, ignore)


@pytest.mark.parametrize("bad", ["", "a/+/b", "a/#"])
async def test_publish_refuses_wildcards_and_empty_topics(bad: str) -> None:
    with pytest.raises(TopicError, match="not a concrete MQTT topic"):
        await client().publish(bad, b"x", timeout_s=0.1)
    with pytest.raises(TopicError):
        Publication(bad, b"x")


@pytest.mark.parametrize(
    "kwargs",
    [{"client_id": ""}, {"client_id": "x" * 129}, {"keepalive_s": 0}, {"timeout_s": 0}],
)
def test_constructor_refuses_bad_settings(kwargs: dict[str, object]) -> None:
    settings: dict[str, object] = {"client_id": "unit", **kwargs}
    with pytest.raises(ValueError, match=r"client_id|positive"):
        ControlClient("127.0.0.1", 9, **settings)  # type: ignore[arg-type]


async def test_publish_without_a_connection_times_out() -> None:
    unstarted = client()
    with pytest.raises(ControlTimeout, match=r"within 0\.05 s \(no connection\)"):
        await unstarted.publish("geofed/acme/events", b"x", timeout_s=0.05)
    with pytest.raises(ControlTimeout, match="no connection to MQTT broker"):
        await unstarted.wait_connected(0.05)


async def test_closed_client_refuses_work_and_run_returns_at_once() -> None:
    closed = client()
    await closed.close(Publication("geofed/acme/events", b"bye"))
    with pytest.raises(NotRunning, match="closed"):
        await closed.publish("geofed/acme/events", b"x", timeout_s=1)
    await asyncio.wait_for(closed.run(), 1)
    with pytest.raises(ControlError, match="already started"):
        await closed.run()
    assert closed.reconnects == 0
    assert closed.connect_failures == 0
