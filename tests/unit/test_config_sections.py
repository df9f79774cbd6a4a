"""The configuration sections both daemons share."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from geofed.config_sections import ConfigSection, IdentityConfig, MqttConfig


def test_mqtt_defaults_to_tls_on_the_standard_port() -> None:
    mqtt = MqttConfig()
    assert (mqtt.host, mqtt.port, mqtt.tls) == ("127.0.0.1", 8883, True)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_plain_mqtt_to_a_loopback_broker_is_allowed(host: str) -> None:
    assert MqttConfig(host=host, port=1883, tls=False).tls is False


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.5", "mqtt.acme.example", "[127.0.0.1]"])
def test_plain_mqtt_leaving_the_machine_is_refused(host: str) -> None:
    with pytest.raises(ValidationError) as caught:
        MqttConfig(host=host, tls=False)
    [error] = caught.value.errors()
    assert error["loc"] == ("tls",)
    assert "plain-text MQTT is allowed only to a loopback broker" in error["msg"]
    assert f"mqtt.host {host!r} is not a loopback address" in error["msg"]


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"port": "8883"}, "port"),
        ({"port": 0}, "port"),
        ({"port": 65536}, "port"),
        ({"tls": "yes"}, "tls"),
        ({"host": ""}, "host"),
        ({"hots": "x"}, "hots"),
    ],
)
def test_mqtt_values_are_checked_strictly(fields: dict[str, object], where: str) -> None:
    with pytest.raises(ValidationError) as caught:
        MqttConfig.model_validate(fields)
    assert [error["loc"] for error in caught.value.errors()] == [(where,)]


def test_identity_names_a_certificate_and_its_key() -> None:
    identity = IdentityConfig.model_validate({"cert": "pki/cert.pem", "key": "pki/key.pem"})
    assert (identity.cert, identity.key) == (Path("pki/cert.pem"), Path("pki/key.pem"))
    with pytest.raises(ValidationError, match="Field required"):
        IdentityConfig.model_validate({"cert": "pki/cert.pem"})


def test_sections_are_frozen_and_refuse_unknown_keys() -> None:
    class Extended(ConfigSection):
        size: int = 1

    section = Extended()
    with pytest.raises(ValidationError, match="frozen"):
        section.size = 2
    with pytest.raises(ValidationError, match="Extra inputs"):
        Extended.model_validate({"size": 2, "colour": "blue"})
