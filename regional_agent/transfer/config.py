"""The ``transfer`` section of the agent's configuration: how much travels at once.

Over a WAN one request at a time spends most of its time waiting a round trip;
several in flight keep the link busy. ``upload_window`` bounds the delta chunks a
region sends at once (each over its own keep-alive connection of the agent's one HTTP
session; the coordinator answers each only once it is durable, whatever the order);
``download_window`` bounds the artifacts of a checkpoint chain fetched at once when a
region resyncs. ``1`` is the serial behaviour.
"""

from __future__ import annotations

from pydantic import Field, StrictInt

from geofed.config_sections import ConfigSection

__all__ = ["DEFAULT_DOWNLOAD_WINDOW", "DEFAULT_UPLOAD_WINDOW", "MAX_WINDOW", "TransferConfig"]

DEFAULT_UPLOAD_WINDOW = 8
DEFAULT_DOWNLOAD_WINDOW = 4
#: More connections than this to one coordinator gain nothing and look like a flood.
MAX_WINDOW = 32


class TransferConfig(ConfigSection):
    """Requests in flight at once to the coordinator (see the module docstring)."""

    upload_window: StrictInt = Field(
        default=DEFAULT_UPLOAD_WINDOW,
        ge=1,
        le=MAX_WINDOW,
        description="delta chunks sent at once (1: one after another)",
    )
    download_window: StrictInt = Field(
        default=DEFAULT_DOWNLOAD_WINDOW,
        ge=1,
        le=MAX_WINDOW,
        description="checkpoint-chain artifacts fetched at once during a resync",
    )
