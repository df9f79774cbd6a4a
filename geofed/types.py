"""Small validated value types shared by every component.

Protocol identifiers (region names, job ids, identities, artifact kinds) are value types
checked once where they enter the system, not bare strings passed around.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

_NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")


class InvalidName(ValueError):
    """A name (region, job, federation, principal) does not follow the naming rule."""


def validate_name(what: str, value: str) -> str:
    """Return ``value`` if it is a DNS-label-like name, else raise :class:`InvalidName`.

    Names end up in MQTT topic levels, URL path segments and SPIFFE URIs, so they are
    restricted to lowercase letters, digits and inner hyphens (1-63 characters).
    """
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise InvalidName(
            f"invalid {what} {value!r}: use 1-63 lowercase letters, digits or inner hyphens"
        )
    return value


class ArtifactKind(StrEnum):
    """What may cross a border; residency rules are written per kind."""

    RAW_DATA = "raw_data"
    REGIONAL_CHECKPOINT = "regional_checkpoint"
    MODEL_DELTA = "model_delta"
    GLOBAL_UPDATE = "global_update"
    GLOBAL_CHECKPOINT = "global_checkpoint"
    METRICS = "metrics"
    LOGS = "logs"


class Role(StrEnum):
    """Roles a federation principal may hold; the role is part of its identity."""

    COORDINATOR = "coordinator"
    REGION = "region"
    OPERATOR = "operator"
    OBSERVER = "observer"


@dataclass(frozen=True, slots=True)
class Identity:
    """A federation principal: ``spiffe://<federation>/<role>/<name>``."""

    federation: str
    role: Role
    name: str

    def __post_init__(self) -> None:
        validate_name("federation", self.federation)
        validate_name(f"{self.role} name", self.name)

    @property
    def uri(self) -> str:
        return f"spiffe://{self.federation}/{self.role.value}/{self.name}"

    @property
    def path(self) -> str:
        """``<role>/<name>``, the form trust-bundle grants are written in."""
        return f"{self.role.value}/{self.name}"

    @classmethod
    def parse(cls, uri: str) -> Identity:
        """Parse a SPIFFE URI; raise :class:`InvalidName` on anything else."""
        prefix = "spiffe://"
        if not uri.startswith(prefix):
            raise InvalidName(f"not a SPIFFE URI: {uri!r}")
        parts = uri[len(prefix) :].split("/")
        if len(parts) != 3:
            raise InvalidName(f"SPIFFE URI must be spiffe://<federation>/<role>/<name>: {uri!r}")
        federation, role, name = parts
        try:
            parsed_role = Role(role)
        except ValueError:
            raise InvalidName(f"unknown role {role!r} in {uri!r}") from None
        return cls(federation=federation, role=parsed_role, name=name)

    def __str__(self) -> str:
        return self.uri
