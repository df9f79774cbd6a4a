"""Opening the state store the coordinator's config names (``state_store``)."""

from __future__ import annotations

from pathlib import Path

from coordinator.config import StateStoreConfig
from coordinator.ha.lease import Fence
from coordinator.state.sqlite import SqliteStore
from coordinator.state.store import Store

__all__ = ["open_state_store"]


def open_state_store(
    config: StateStoreConfig, state_dir: Path, fence: Fence | None = None
) -> Store:
    """The configured store, opened and migrated (blocking: call it off the event loop).

    SQLite lives in ``state_dir``; PostgreSQL is reached through the config's ``dsn``,
    its writes fenced by the leader lease's ``fence`` when coordinators share it.
    Raises :class:`~coordinator.state.store.StoreFailure` when it cannot be opened.
    """
    if config.kind == "postgresql":
        from coordinator.state.postgres import PostgresStore  # needs the optional psycopg

        if config.dsn is None:  # the config model refuses this; kept for the type checker
            raise ValueError("state_store: kind postgresql needs a dsn")
        return PostgresStore(config.dsn, fence=fence)
    return SqliteStore.in_state_dir(state_dir)
