"""EmbeddedBroker settings checked before anything binds."""

from __future__ import annotations

import pytest

from geofed.control import BrokerError
from geofed.control.broker import EmbeddedBroker


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "example.com", "::"])
def test_embedded_broker_refuses_non_loopback_hosts(host: str) -> None:
    with pytest.raises(BrokerError, match="loopback"):
        EmbeddedBroker(host=host)


def test_embedded_broker_validates_port_and_formats_url() -> None:
    with pytest.raises(BrokerError, match="port"):
        EmbeddedBroker(port=70000)
    assert EmbeddedBroker("::1", 1883).url == "mqtt://[::1]:1883"
    assert EmbeddedBroker("localhost", 1883).url == "mqtt://localhost:1883"
    assert not EmbeddedBroker().running
