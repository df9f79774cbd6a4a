"""Loopback hosts: the one test of whether a host name or address leaves this machine.

Plain text (HTTP without TLS, MQTT without TLS) is allowed only to a loopback host, so
every daemon and the command line decide it here, the same way.
"""

from __future__ import annotations

import ipaddress

__all__ = ["is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine.

    ``localhost``, any address of 127.0.0.0/8, and ``::1`` (bare or bracketed as in a URL,
    ``[::1]``) are; every other name or address is not, including names that a resolver
    might map to a loopback address (the check must not depend on DNS).
    """
    if host == "localhost":
        return True
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            return False  # brackets enclose only IPv6 addresses
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
