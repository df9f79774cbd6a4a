"""The loopback test that decides where plain text is allowed."""

from __future__ import annotations

import pytest

from geofed.loopback import is_loopback


@pytest.mark.parametrize(
    "host", ["localhost", "127.0.0.1", "127.0.0.53", "127.255.255.254", "::1", "[::1]"]
)
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host",
    [
        "",
        "0.0.0.0",
        "::",
        "10.0.0.5",
        "128.0.0.1",
        "::2",
        "[127.0.0.1]",
        "[::1",
        "::1]",
        "[[::1]]",
        "localhost.example",
        "mylocalhost",
        "coordinator.acme.example",
    ],
)
def test_other_hosts(host: str) -> None:
    assert not is_loopback(host)
