"""The daemon's side of the leader lease: stand by until leading, then renew or step down.

:meth:`Leadership.acquire` waits as a standby (trying every ``renew_every_s``) until this
coordinator holds the lease, and returns the :class:`~coordinator.ha.lease.Fence` its
store writes under. :meth:`Leadership.hold` then renews the lease until cancelled; when
the lease is lost (a new token in the row) or cannot be renewed before it runs out on
this machine's clock, it calls ``deposed(reason)`` and returns: the daemon stops serving
and exits with the runtime-error code, so systemd restarts it as a standby. Every lease
call runs in a thread under a timeout, so a database that stops answering never stalls
the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Protocol

from coordinator.config import LeaderLeaseConfig
from coordinator.ha.lease import Fence, LeaseDecision, step_down_reason
from coordinator.state.store import StoreFailure
from geofed.sdnotify import Notifier
from geofed.timeouts import Timeout, wait_event, wait_for

__all__ = ["Deposed", "Leadership", "holder_name"]

log = logging.getLogger(__name__)

#: The share of the lease a leader gives up to clock-rate drift between it and the server.
DRIFT_MARGIN = 0.1


class LeaseBackend(Protocol):
    """Where the lease row lives (:class:`~coordinator.ha.postgres_lease.PostgresLease`)."""

    holder: str

    @property
    def fence(self) -> Fence | None: ...

    def attempt(self) -> LeaseDecision: ...

    def release(self) -> bool: ...

    def close(self) -> None: ...


class Deposed(Exception):
    """This coordinator lost the leader lease while serving; it must stop."""


def holder_name(identity: str) -> str:
    """A holder name unique to this process: identity, host and pid."""
    return f"{identity}@{socket.gethostname()}:{os.getpid()}"


class Leadership:
    """One coordinator's lease (see the module docstring)."""

    def __init__(
        self,
        lease: LeaseBackend,
        config: LeaderLeaseConfig,
        notifier: Notifier,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lease = lease
        self._config = config
        self._notifier = notifier
        self._monotonic = monotonic
        self._valid_until = 0.0
        self.leading_since: float | None = None
        #: While standing by: who leads as last seen ('' unknown) and why this one waits.
        self.leader = ""
        self.standby_reason = "waiting for the leader lease"

    @classmethod
    async def open(
        cls, dsn: str, config: LeaderLeaseConfig, holder: str, notifier: Notifier
    ) -> Leadership:
        """Connect to the lease (raises :class:`StoreFailure`)."""
        # Imported here: only a coordinator with a leader lease loads PostgreSQL's driver
        # (a sixth of a second at every start of one without).
        from coordinator.ha.postgres_lease import PostgresLease

        lease = await wait_for(
            asyncio.to_thread(
                PostgresLease,
                dsn,
                holder,
                ttl_s=config.ttl_s,
                name=config.name,
                timeout_s=_call_timeout(config),
            ),
            _call_timeout(config) * 2,
            "connecting to the leader lease",
        )
        return cls(lease, config, notifier)

    @property
    def holder(self) -> str:
        return self._lease.holder

    async def acquire(self, stop: asyncio.Event) -> Fence | None:
        """Stand by until this coordinator leads (its fence) or ``stop`` is set (None)."""
        said: str | None = None
        while not stop.is_set():
            try:
                decision = await self._attempt()
            except (StoreFailure, Timeout) as exc:
                reason = f"cannot reach the leader lease: {exc}"
            else:
                if decision.leading:
                    fence = self._lease.fence
                    assert fence is not None  # leading: the lease keeps its token
                    self.leading_since = self._monotonic()
                    log.info("leading as %s: %s", self.holder, decision.reason)
                    return fence
                reason = decision.reason
                self.leader = decision.lease.holder
            self.standby_reason = reason
            if reason != said:
                log.info("standby: %s", reason)
                self._notifier.status(f"standby: {reason}")
                said = reason
            await wait_event(stop, self._config.renew_interval_s)
        return None

    async def hold(self, deposed: Callable[[str], None]) -> None:
        """Renew until cancelled; on loss call ``deposed(reason)`` and return."""
        while True:
            await asyncio.sleep(self._config.renew_interval_s)
            try:
                decision = await self._attempt()
            except (StoreFailure, Timeout) as exc:
                reason = step_down_reason(self._monotonic(), self._valid_until)
                if reason is not None:
                    deposed(f"{reason} (last error: {exc})")
                    return
                log.warning("cannot renew the leader lease, retrying: %s", exc)
                continue
            if not decision.leading:
                deposed(decision.reason)
                return

    async def release(self) -> None:
        """Hand the lease over now (a clean stop): a standby need not wait for expiry."""
        try:
            released = await wait_for(
                asyncio.to_thread(self._lease.release),
                _call_timeout(self._config),
                "releasing the leader lease",
            )
        except (StoreFailure, Timeout) as exc:
            log.warning("could not release the leader lease (it expires by itself): %s", exc)
            return
        if released:
            log.info("released the leader lease")

    async def close(self) -> None:
        await asyncio.to_thread(self._lease.close)

    async def _attempt(self) -> LeaseDecision:
        started = self._monotonic()
        decision = await wait_for(
            asyncio.to_thread(self._lease.attempt),
            _call_timeout(self._config),
            "the leader lease",
        )
        if decision.leading:
            # The server's expiry is at least ttl after this call began, on its clock.
            self._valid_until = started + self._config.ttl_s * (1 - DRIFT_MARGIN)
        return decision


def _call_timeout(config: LeaderLeaseConfig) -> float:
    """How long one lease call may take: within a renewal interval, at most 5 s."""
    return max(0.5, min(5.0, config.renew_interval_s))
