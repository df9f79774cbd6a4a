"""The userspace WAN proxy of the fault tests: :mod:`geofed.wanemu`, under its old name.

    async with WanProxy("127.0.0.1", 0, "127.0.0.1", coordinator_port, seed=7) as wan:
        wan.upstream = LinkSettings(latency_s=0.05, bandwidth_bps=2_000_000)
        ...                                   # point the agent at 127.0.0.1:wan.port
        wan.partition(); ...; wan.heal()

The emulator lives in the product (``geofed demo --wan`` uses it); its behaviour
(bandwidth, latency, seeded resets, partitions) is documented there.
"""

from __future__ import annotations

from geofed.wanemu import (
    Direction,
    InvalidSettings,
    LinkSettings,
    TokenBucket,
    WanProxy,
    WanProxyError,
    WanStats,
    plan_reset,
)

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
