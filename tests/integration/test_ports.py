"""unused_port picks a port nothing holds, outside the ephemeral range, skipping held ones."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from geofed.ports import candidate_range, ephemeral_range, unused_port

pytestmark = pytest.mark.integration

SETTING = Path("/proc/sys/net/ipv4/ip_local_port_range")


def test_a_picked_port_lies_outside_the_ephemeral_range_and_binds() -> None:
    low, high = ephemeral_range(SETTING.read_text())
    port = unused_port()
    assert not low <= port <= high
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_a_held_port_is_skipped() -> None:
    span = candidate_range(ephemeral_range(SETTING.read_text()))
    assert span is not None
    first = random.Random(7).randrange(*span)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", first))
        holder.listen()
        port = unused_port(rng=random.Random(7))
    assert port != first
