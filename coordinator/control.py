"""The coordinator's side of the MQTT control plane.

It publishes each job's round announcement (retained, re-published after every
reconnect so a broker that lost it gets it back), events and region commands, and
follows every region's retained status to know which regions are up (a Last Will wins
over the statuses it outlived: :func:`coordinator.rounds.region_status.take_status`). A publish
that cannot be acknowledged in time is logged, never raised into the round engine: the
announcement is re-sent when the link comes back. Agents learn of rounds only from these
announcements; over HTTPS they download parameters and upload deltas, and an upload into
a round that has moved on is answered ``round_closed`` (or ``wrong_round``). While the
broker is unreachable, announcements and events are not waited for at all (the round
engine keeps closing and publishing rounds whose deltas arrive over HTTPS); commands
still wait for the link, up to the request timeout.
"""

from __future__ import annotations

import logging
import math
import ssl
from collections.abc import Awaitable, Callable
from typing import Literal

from coordinator.config import CoordinatorConfig
from coordinator.metrics import CoordinatorMetrics
from coordinator.rounds.region_status import RegionView, take_status
from geofed.control import (
    Command,
    ControlClient,
    ControlError,
    Deduplicator,
    Event,
    HardwareSummary,
    MessageError,
    RegionStatus,
    RoundAnnouncement,
    TopicError,
    Topics,
    decode,
    encode,
)

__all__ = ["ControlPlane", "RegionView"]

log = logging.getLogger(__name__)

CommandAction = Literal["pause", "resume", "cancel", "resync", "drain", "checkpoint"]


class ControlPlane:
    """Announcements, events and commands out; region statuses in."""

    def __init__(
        self,
        config: CoordinatorConfig,
        tls: ssl.SSLContext | None,
        metrics: CoordinatorMetrics,
        known_regions: frozenset[str],
    ) -> None:
        timeouts = config.timeouts
        self.topics = Topics(config.federation)
        self.client = ControlClient(
            config.mqtt.host,
            config.mqtt.port,
            client_id=config.mqtt_client_id,
            tls=tls,
            keepalive_s=max(1, math.ceil(timeouts.heartbeat_s)),
            timeout_s=timeouts.request_s,
            handler_timeout_s=timeouts.request_s,
        )
        self._timeout_s = timeouts.request_s
        self._metrics = metrics
        self._known = known_regions
        self._retained: dict[str, bytes] = {}
        self._dedup = Deduplicator()
        self.regions: dict[str, RegionView] = {}
        #: Each region's hardware as last reported (a Last Will carries none: kept).
        self.last_hardware: dict[str, HardwareSummary] = {}
        #: The uncorrectable ECC count of each (region, host) in the first status this
        #: process took that had one: new errors are counted from it (hardware risk).
        self.ecc_first_seen: dict[tuple[str, str], int] = {}
        self._region_listeners: list[Callable[[str], None]] = []
        self._refusal_listeners: list[Callable[[str, RegionStatus], Awaitable[None]]] = []
        for region in known_regions:
            metrics.region_up.labels(region=region).set(0)
        metrics.regions_up.set(0)
        metrics.mqtt_connected.set_function(lambda: 1.0 if self.connected else 0.0)

    @property
    def connected(self) -> bool:
        return self.client.connected.is_set()

    def on_region_change(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(region)`` when a region goes up or down or its capacity changes.

        Called in the status handler's task: it must not block.
        """
        self._region_listeners.append(listener)

    def on_region_refusal(self, listener: Callable[[str, RegionStatus], Awaitable[None]]) -> None:
        """Await ``listener(region, status)`` for each status taken that says the region
        refused a round itself (a failing listener is logged, the status still taken)."""
        self._refusal_listeners.append(listener)

    async def start(self) -> None:
        """Register the status subscription and the reconnect hook; run ``client.run()`` next."""
        self.client.on_connect(self._on_connect)
        await self.client.subscribe(self.topics.all_region_status(), self._on_status)

    async def close(self) -> None:
        await self.client.close(timeout_s=self._timeout_s)

    async def announce(self, announcement: RoundAnnouncement) -> None:
        """Publish a job's round announcement, retained; kept to re-send after reconnects."""
        topic = self.topics.job_round(announcement.job)
        payload = encode(announcement)
        self._retained[topic] = payload
        await self._publish(topic, payload, retain=True, wait=False)

    async def event(
        self,
        kind: str,
        *,
        job: str | None = None,
        round: int | None = None,
        region: str | None = None,
        detail: str = "",
    ) -> None:
        message = Event(kind=kind, job=job, round=round, region=region, detail=detail[:4096])
        await self._publish(self.topics.events(), encode(message), retain=False, wait=False)

    async def command(
        self,
        region: str,
        action: CommandAction,
        job: str,
        reason: str,
        round: int | None = None,
    ) -> bool:
        """Send ``region`` a command; whether the broker took it (False: not now)."""
        message = Command(action=action, job=job, reason=reason[:4096], round=round)
        return await self._publish(
            self.topics.region_commands(region), encode(message), retain=False
        )

    async def _publish(
        self, topic: str, payload: bytes, *, retain: bool, wait: bool = True
    ) -> bool:
        """Publish; with ``wait`` False, give up at once while the broker is unreachable.
        Whether the broker took the message."""
        if not wait and not self.connected:
            # Waiting would hold the round engine up for the request timeout per message;
            # the latest announcement is re-sent on reconnect, events are informational.
            log.warning("control message to %s not delivered now: no broker connection", topic)
            return False
        try:
            # Not waiting: a connection lost mid-publish gives up too (re-sent on reconnect).
            await self.client.publish(
                topic, payload, retain=retain, timeout_s=self._timeout_s, once=not wait
            )
        except ControlError as exc:
            log.warning("control message to %s not delivered now: %s", topic, exc)
            return False
        return True

    async def _on_connect(self) -> None:
        for topic, payload in list(self._retained.items()):
            await self._publish(topic, payload, retain=True)

    async def _on_status(self, topic: str, payload: bytes) -> None:
        try:
            region = self.topics.parse(topic).region
            status = decode(payload, RegionStatus)
        except (TopicError, MessageError) as exc:
            log.warning("ignored region status on %s: %s", topic, exc)
            return
        if status.region != region or region not in self._known:
            log.warning(
                "ignored status of %s on %s: no policy names that region", status.region, topic
            )
            return
        if not self._dedup.first_time(status.message_id):
            return
        view, reason = take_status(self.regions.get(region), status)
        if view is None:
            log.info("ignored a status of %s sent at %s: %s", region, status.sent_at, reason)
            return
        before = self.regions.get(region)
        self.regions[region] = view
        hardware = status.hardware
        if hardware is not None:
            self.last_hardware[region] = hardware
            if hardware.ecc_uncorrected is not None:
                key = (region, hardware.host)
                self.ecc_first_seen.setdefault(key, hardware.ecc_uncorrected)
        if before is None or (before.up, before.status.capacity) != (view.up, status.capacity):
            for listener in self._region_listeners:
                listener(region)
        if status.refused:
            for refusal in self._refusal_listeners:
                try:
                    await refusal(region, status)
                except Exception:  # the audit is down, say: the region's status still counts
                    log.exception("recording %s's refusal failed", region)
        self._metrics.region_up.labels(region=region).set(1 if status.state != "offline" else 0)
        self._metrics.regions_up.set(sum(1 for view in self.regions.values() if view.up))
