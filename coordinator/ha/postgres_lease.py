"""The leader lease in the coordinators' shared PostgreSQL database.

One row per lease in ``geofed_leader_lease`` (created if missing, seeded with an expired
row so a first holder has a row to lock). An attempt locks the row (``FOR UPDATE``), reads
the server's clock, decides with :func:`coordinator.ha.lease.decide` and writes the
outcome, in one transaction, so two coordinators never both acquire it. A coordinator
that does not lead first takes the stores' writer lock
(:data:`coordinator.state.postgres.WRITER_LOCK`): a takeover then waits for the old
leader's transaction in progress, which checked the old token under that lock, to end,
and every later one sees the new token and is fenced. Blocking, like the store: the
daemon calls it from a thread, under a timeout.
"""

from __future__ import annotations

import threading

from coordinator.ha.lease import Fence, Lease, LeaseDecision, decide
from coordinator.state.postgres import LEASE_TABLE, WRITER_LOCK, describe_dsn
from coordinator.state.store import StoreFailure

try:  # an optional dependency: only a coordinator configured for PostgreSQL needs it
    import psycopg

    _MISSING = ""
except ImportError as _exc:  # pragma: no cover - exercised where psycopg is missing
    _MISSING = str(_exc)

__all__ = ["PostgresLease"]

_CREATE = f"""CREATE TABLE IF NOT EXISTS {LEASE_TABLE} (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    token BIGINT NOT NULL CHECK (token >= 0),
    expires_at DOUBLE PRECISION NOT NULL)"""


class PostgresLease:
    """``holder``'s view of the lease ``name``; :meth:`attempt` acquires or renews it."""

    def __init__(
        self,
        dsn: str,
        holder: str,
        *,
        ttl_s: float,
        name: str = "coordinator",
        timeout_s: float = 5.0,
    ) -> None:
        if _MISSING:
            raise StoreFailure(f"the leader lease needs psycopg 3: {_MISSING}")
        self.holder = holder
        self.name = name
        self._ttl_s = ttl_s
        self._token: int | None = None
        self._where = describe_dsn(dsn)
        self._lock = threading.Lock()
        try:
            self._conn = psycopg.connect(
                dsn,
                autocommit=True,
                connect_timeout=max(1, round(timeout_s)),
                options=f"-c statement_timeout={round(timeout_s * 1000)}",
            )
            with self._conn.transaction():
                # Two coordinators starting at once both run this: serialize the creation.
                self._conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (LEASE_TABLE,))
                self._conn.execute(_CREATE)
                self._conn.execute(
                    f"INSERT INTO {LEASE_TABLE} (name, holder, token, expires_at)"  # noqa: S608
                    " VALUES (%s, '', 0, 0) ON CONFLICT (name) DO NOTHING",
                    (name,),
                )
        except psycopg.Error as exc:
            raise StoreFailure(f"leader lease on {self._where}: {exc}") from exc

    @property
    def fence(self) -> Fence | None:
        """The fence of the lease this holder leads with (None: it does not lead)."""
        return None if self._token is None else Fence(self.name, self._token)

    def attempt(self) -> LeaseDecision:
        """Acquire, renew, or learn who leads; raises :class:`StoreFailure` if unreachable."""
        with self._lock:
            try:
                with self._conn.transaction():
                    if self._token is None:
                        self._conn.execute("SELECT pg_advisory_xact_lock(%s)", (WRITER_LOCK,))
                    row = self._conn.execute(
                        f"SELECT holder, token, expires_at FROM {LEASE_TABLE}"  # noqa: S608
                        " WHERE name = %s FOR UPDATE",
                        (self.name,),
                    ).fetchone()
                    clock = self._conn.execute(
                        "SELECT extract(epoch FROM clock_timestamp())::double precision"
                    ).fetchone()
                    if row is None or clock is None:
                        raise StoreFailure(f"lease {self.name!r} vanished from {self._where}")
                    current = Lease(str(row[0]), int(row[1]), float(row[2]))
                    decision = decide(
                        current, self.holder, self._token, float(clock[0]), self._ttl_s
                    )
                    if decision.leading:
                        lease = decision.lease
                        self._conn.execute(
                            f"UPDATE {LEASE_TABLE} SET holder = %s, token = %s,"  # noqa: S608
                            " expires_at = %s WHERE name = %s",
                            (lease.holder, lease.token, lease.expires_at, self.name),
                        )
            except psycopg.Error as exc:
                raise StoreFailure(f"leader lease on {self._where}: {exc}") from exc
            self._token = decision.lease.token if decision.leading else None
            return decision

    def release(self) -> bool:
        """Let the lease expire now if this holder still leads (a standby takes over at once)."""
        with self._lock:
            if self._token is None:
                return False
            try:
                released = self._conn.execute(
                    f"UPDATE {LEASE_TABLE} SET expires_at = 0"  # noqa: S608
                    " WHERE name = %s AND holder = %s AND token = %s",
                    (self.name, self.holder, self._token),
                ).rowcount
            except psycopg.Error as exc:
                raise StoreFailure(f"leader lease on {self._where}: {exc}") from exc
            self._token = None
            return bool(released)

    def close(self) -> None:
        with self._lock:
            self._conn.close()
