"""The control plane in integration tests: inboxes, running clients, an agent process.

Shared by ``tests/integration/test_control_embedded.py`` (the embedded broker) and
``tests/integration/test_control_mosquitto.py`` (a real Mosquitto).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from geofed.control import ControlClient, Topics

TOPICS = Topics("acme")


class Inbox:
    """Collects (topic, payload) pairs a handler receives."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()

    async def __call__(self, topic: str, payload: bytes) -> None:
        await self.queue.put((topic, payload))

    async def get(self, timeout_s: float = 5.0) -> tuple[str, bytes]:
        return await asyncio.wait_for(self.queue.get(), timeout_s)

    async def until(self, predicate: Any, timeout_s: float = 5.0) -> tuple[str, bytes]:
        async with asyncio.timeout(timeout_s):
            while True:
                item = await self.queue.get()
                if predicate(*item):
                    return item


class RecordingSleep:
    """A fake clock's sleep: records each back-off delay and yields only briefly."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        await asyncio.sleep(0.02)


@asynccontextmanager
async def running(client: ControlClient) -> AsyncIterator[ControlClient]:
    """``client`` running and connected for the block; closed cleanly after it."""
    task = asyncio.create_task(client.run())
    try:
        await client.wait_connected(5.0)
        yield client
    finally:
        await client.close(timeout_s=5.0)
        await asyncio.wait_for(task, 5.0)


AGENT_SCRIPT = """
import asyncio, sys
from pathlib import Path
from geofed.control import ControlClient, Publication, RegionStatus, Topics, encode

async def main(port: int, tls_files: list[str]) -> None:
    tls = None
    if tls_files:
        from geofed.pki import client_ssl_context, load_trust_bundle
        bundle, cert, key = (Path(p) for p in tls_files)
        tls = client_ssl_context(load_trust_bundle(bundle), cert, key)
    topic = Topics("acme").region_status("eu-west")
    offline = encode(RegionStatus(region="eu-west", state="offline", agent_version="test"))
    client = ControlClient("127.0.0.1", port, client_id="agent-eu-west", keepalive_s=2, tls=tls,
                           will=Publication(topic, offline, retain=True))
    task = asyncio.create_task(client.run())
    online = RegionStatus(region="eu-west", state="online", agent_version="test")
    await client.publish(topic, encode(online), retain=True)
    print("ready", flush=True)
    await task

asyncio.run(main(int(sys.argv[1]), sys.argv[2:]))
"""
#: Mosquitto 2.0.11 took 4.6-4.8 s to drop a silent client with keep-alive 2 s on an idle
#: machine; the slack covers a loaded one (a broker that never drops it still fails).
KEEPALIVE_S, SLACK_S = 2, 20.0


async def start_agent(port: int, *tls_files: str) -> subprocess.Popen[bytes]:
    """Start the agent script in a child process; return once its status is published."""
    child = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, "-c", AGENT_SCRIPT, str(port), *tls_files],
        stdout=subprocess.PIPE,
    )
    assert child.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)
    assert line.strip() == b"ready", f"agent did not start (exit code {child.poll()})"
    return child


def reap(child: subprocess.Popen[bytes]) -> None:
    """Kill an agent started by :func:`start_agent` and wait for it."""
    child.kill()
    child.wait(timeout=10)
    if child.stdout is not None:
        child.stdout.close()
