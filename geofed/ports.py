"""A TCP port for a process that binds it later (a daemon, a rendezvous store).

``bind(0)`` hands out a port from the kernel's ephemeral range, the range every outgoing
connection on the host also takes its local port from: between the pick and the other
process's bind, any ``connect()`` may take that port and the bind fails with
``EADDRINUSE``. Ports picked here lie below the ephemeral range, where only explicit binds
land; a random pick, checked by a bind, keeps concurrent pickers apart.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: Linux's default ephemeral range, used where the kernel's setting cannot be read.
DEFAULT_EPHEMERAL = (32768, 60999)
#: Below this lie well-known and registered services' usual ports.
LOWEST = 10000
_SETTING = Path("/proc/sys/net/ipv4/ip_local_port_range")
_TRIES = 64


def ephemeral_range(text: str | None) -> tuple[int, int]:
    """The kernel's ephemeral range from ``ip_local_port_range``'s text (None: unreadable)."""
    try:
        low, high = (int(part) for part in (text or "").split())
    except ValueError:
        return DEFAULT_EPHEMERAL
    return (low, high) if 0 < low <= high <= 65535 else DEFAULT_EPHEMERAL


def candidate_range(ephemeral: tuple[int, int]) -> tuple[int, int] | None:
    """Ports to pick from, ``[low, high)``, outside ``ephemeral``; None when there is no room.

    Below the ephemeral range if at least 1000 ports lie between it and LOWEST, else above it.
    """
    low, high = ephemeral
    if low - LOWEST >= 1000:
        return LOWEST, low
    if 65536 - (high + 1) >= 1000:
        return high + 1, 65536
    return None


def _read_setting() -> str | None:
    try:
        return _SETTING.read_text()
    except OSError:
        return None


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def unused_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port on ``host`` that nothing holds now and no outgoing connection will take."""
    choose = rng or random.SystemRandom()
    span = candidate_range(ephemeral_range(_read_setting()))
    if span is not None:
        for _ in range(_TRIES):
            port = choose.randrange(*span)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
