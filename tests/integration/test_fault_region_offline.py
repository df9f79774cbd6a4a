"""A crashed region is seen offline: its Last Will wins over the statuses it outlived.

Real processes on a real Mosquitto (the production config, TLS, the generated ACL): the
coordinator and one agent. Once the agent has reported itself ready, it is killed with
SIGKILL (no goodbye). The broker publishes its Last Will, which was registered when the
agent connected and so carries an older ``sent_at`` than the statuses it outlived; the
coordinator must still show the region offline (``GET /v1/regions``, and
``geofed_region_up`` 0, which ``GeofedRegionDown`` watches) within the agent's keep-alive.
Restarted, the agent's new statuses replace the Will and the region is up again.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.federation import FederationRun, running_federation
from tests.support.observe import reap_orphans, sample

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REGION = "eu-west"
#: The agent's heartbeat_s, which is also its MQTT keep-alive.
HEARTBEAT_S = 2


def configure(name: str, data: dict[str, Any]) -> None:
    if name.startswith("agent-"):
        data["timeouts"]["heartbeat_s"] = HEARTBEAT_S


async def region_seen(fed: FederationRun) -> tuple[str, float]:
    """The region's state in ``GET /v1/regions`` and its ``geofed_region_up``."""
    body = await fed.get("/v1/regions")
    (entry,) = [e for e in body["regions"] if e["region"] == REGION]
    up = sample(await fed.metrics_text(), "geofed_region_up", region=REGION)
    return str(entry["state"]), up


async def wait_seen(
    fed: FederationRun, wanted: tuple[bool, float], what: str, timeout_s: float
) -> float:
    """Poll until the region is (offline?, region_up) as ``wanted``; return the seconds taken."""
    started = time.monotonic()
    seen: tuple[str, float] = ("", -1.0)
    while time.monotonic() - started < timeout_s:
        seen = await region_seen(fed)
        state, up = seen
        if ((state == "offline"), up) == wanted:
            return time.monotonic() - started
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what}: still {seen} after {timeout_s} s\n{fed.log_tails()}")


async def test_a_killed_agent_is_offline_within_its_keepalive_and_back_after_a_restart(
    tmp_path: Path,
) -> None:
    async with running_federation(
        tmp_path, regions=(REGION,), broker="mosquitto", customize=configure
    ) as fed:
        try:

            async def ready() -> None:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    fed.children.check_alive()
                    body = await fed.get("/v1/regions")
                    (entry,) = [e for e in body["regions"] if e["region"] == REGION]
                    if entry.get("detail") == "ready":
                        return
                    await asyncio.sleep(0.2)
                raise AssertionError(f"{REGION} never reported ready\n{fed.log_tails()}")

            await ready()
            assert await region_seen(fed) == ("online", 1.0)
            # Statuses sent after the connection began, so newer than its Will.
            await asyncio.sleep(HEARTBEAT_S + 0.5)

            await fed.kill(f"agent-{REGION}")
            down_s = await wait_seen(
                fed, (True, 0.0), "the killed agent seen offline", timeout_s=30.0
            )
            body = await fed.get("/v1/regions")
            (entry,) = [e for e in body["regions"] if e["region"] == REGION]
            assert entry["detail"] == "connection lost", entry
            assert sample(await fed.metrics_text(), "geofed_regions_up") == 0

            await fed.restart(f"agent-{REGION}")
            up_s = await wait_seen(fed, (False, 1.0), "the restarted agent seen up", 120.0)
        finally:
            reap_orphans(fed, REGION)

    # The broker publishes the Will as soon as it sees the connection close, at the latest
    # 1.5 keep-alives after the last packet.
    assert down_s < 1.5 * HEARTBEAT_S + 1.0, down_s
    print(f"\nkill -9 to offline at the coordinator {down_s:.2f} s; restart to up {up_s:.1f} s")
