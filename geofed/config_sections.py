"""The configuration sections both daemons' files share, and the base of every section.

A section is a frozen pydantic model that refuses unknown keys, so a misspelt key is an
error naming its file and line rather than a setting silently left at its default. A
daemon that needs more in a shared section subclasses it.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
)

from geofed.loopback import is_loopback

__all__ = ["ConfigSection", "IdentityConfig", "MqttConfig"]


class ConfigSection(BaseModel):
    """A section of a configuration file: unknown keys are errors, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class IdentityConfig(ConfigSection):
    """A daemon's own credential, issued by ``geofed ca issue``."""

    cert: Path = Field(description="PEM certificate naming the daemon's spiffe:// identity")
    key: Path = Field(description="PEM private key of that certificate")


class MqttConfig(ConfigSection):
    """The control-plane broker."""

    host: str = Field(default="127.0.0.1", min_length=1)
    port: StrictInt = Field(default=8883, ge=1, le=65535)
    tls: StrictBool = Field(
        default=True,
        description="mutual TLS with the identity credential; plain TCP only to a loopback "
        "broker (the embedded demo broker)",
    )

    @field_validator("tls")
    @classmethod
    def _plain_only_on_loopback(cls, value: bool, info: ValidationInfo) -> bool:
        # Plain MQTT carries the control plane unencrypted: it must not leave the machine.
        host = info.data.get("host")
        if not value and isinstance(host, str) and not is_loopback(host):
            raise ValueError(
                "plain-text MQTT is allowed only to a loopback broker; "
                f"mqtt.tls: false, but mqtt.host {host!r} is not a loopback address "
                "(set tls: true)"
            )
        return value
