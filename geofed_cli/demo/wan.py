"""``geofed demo --wan``: each region reaches the coordinator through an emulated WAN link.

One :class:`~geofed.wanemu.WanProxy` per region, in the demo's own event loop, between the
region's agent and the coordinator's HTTPS port: the agent's ``coordinator_url`` points at
its proxy, which adds the link's bandwidth cap in each direction and half its RTT each
way. TLS runs end to end through it (the proxy forwards bytes). The control plane (MQTT)
stays on loopback: announcements are small, and the demo measures the data plane.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from geofed.wanemu import LinkSettings, WanProxy
from geofed.wanspec import WanLink

#: Seeds the proxies' reset plans; the demo's links never reset, so any fixed value does.
_SEED = 0


@asynccontextmanager
async def wan_links(
    link: WanLink | None, regions: Sequence[str], coordinator_port: int, *, always: bool = False
) -> AsyncIterator[dict[str, WanProxy]]:
    """Region -> its WAN link (proxy) to the coordinator; ``{}`` without one.

    ``always``: a plain, unlimited link per region even without ``link``, so that a
    region can be cut off (``geofed demo --chaos``).
    """
    if link is None and not always:
        yield {}
        return
    settings = link.settings() if link is not None else LinkSettings()
    async with AsyncExitStack() as stack:
        proxies = {}
        for region in regions:
            proxy = WanProxy(
                "127.0.0.1",
                0,
                "127.0.0.1",
                coordinator_port,
                seed=_SEED,
                upstream=settings,
                downstream=settings,
            )
            proxies[region] = await stack.enter_async_context(proxy)
        yield proxies


def route_configs(
    ports: dict[str, int], *, overlap: str | None
) -> Callable[[str, dict[str, Any]], None]:
    """The ``customize`` hook of the demo's configs: each agent's coordinator URL through
    its WAN link, and the job's ``overlap`` mode when one was asked for."""

    def customize(name: str, data: dict[str, Any]) -> None:
        region = name.removeprefix("agent-")
        if name.startswith("agent-") and region in ports:
            data["coordinator_url"] = f"https://localhost:{ports[region]}"
        if name == "job" and overlap is not None:
            data["overlap"] = overlap

    return customize
