"""The ``transfer`` section of the agent's configuration: how much travels at once.

Over a WAN one request at a time spends most of its time waiting a round trip;
several in flight keep the link busy. ``upload_window`` bounds the delta chunks a
region sends at once (each over its own keep-alive connection of the agent's one HTTP
session; the coordinator answers each only once it is durable, whatever the order);
``download_window`` bounds the artifacts of a checkpoint chain fetched at once when a
region resyncs. ``1`` is the serial behaviour.

``theta_file_every`` is how often the agent writes θ whole, as a θ file: in between, θ_r
is the last θ file plus the verified updates after it, each kept in the file it was
downloaded to (:mod:`geofed.theta_chain`), and whoever reads θ (the agent hashing it,
rank 0 loading it and forming the delta) adds the updates' pieces to the file's values
as it reads. ``1`` writes θ whole every round (4 bytes a parameter; the update adds 1);
``N`` writes it once every N rounds and reads up to N - 1 updates more each time θ is
read.
"""

from __future__ import annotations

from pydantic import Field, StrictInt

from geofed.config_sections import ConfigSection

__all__ = [
    "DEFAULT_DOWNLOAD_WINDOW",
    "DEFAULT_THETA_FILE_EVERY",
    "DEFAULT_UPLOAD_WINDOW",
    "MAX_WINDOW",
    "TransferConfig",
]

DEFAULT_UPLOAD_WINDOW = 8
DEFAULT_DOWNLOAD_WINDOW = 4
DEFAULT_THETA_FILE_EVERY = 8
#: A longer chain is read (every update of it decoded) each time θ is read.
MAX_THETA_FILE_EVERY = 64
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
    theta_file_every: StrictInt = Field(
        default=DEFAULT_THETA_FILE_EVERY,
        ge=1,
        le=MAX_THETA_FILE_EVERY,
        description="rounds between θ files written whole (1: every round); in between, "
        "θ is the last θ file and the updates after it",
    )
