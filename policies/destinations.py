"""Endpoints an artifact can move between, and the patterns export rules match them with.

Destination syntax (used in policy files and on the command line):

- ``coordinator``          the federation's global coordinator;
- ``region:NAME``          the region NAME itself (its agents and local disks);
- ``storage:NAME``         the storage location NAME declared in some region's policy;
- ``jurisdiction:CODE``    anything located in jurisdiction CODE (a region, a storage
                           location, or the coordinator when its jurisdiction is known);
- ``*``                    anywhere.

Each pattern matches exactly what it names: ``region:eu-west`` does not match a storage
location owned by eu-west; use ``storage:NAME`` or ``jurisdiction:CODE`` for storage.
Sources and destinations of a concrete transfer are written the same way without the
pattern forms (``coordinator``, ``region:NAME``, ``storage:NAME``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from geofed.types import InvalidName, validate_name
from policies.errors import InvalidDestination

_JURISDICTION_RE = re.compile(r"^[A-Z][A-Z0-9-]{0,15}$")


def validate_jurisdiction(value: str) -> str:
    """Return ``value`` if it is a jurisdiction code (``EU``, ``US``, ``IN``, ``US-CA``)."""
    if not isinstance(value, str) or not _JURISDICTION_RE.fullmatch(value):
        raise InvalidDestination(
            f"invalid jurisdiction {value!r}: use an upper-case code such as EU, US or IN "
            "(letters, digits, inner hyphens; at most 16 characters)"
        )
    return value


class EndpointKind(StrEnum):
    """What kind of place an artifact is at or goes to."""

    COORDINATOR = "coordinator"
    REGION = "region"
    STORAGE = "storage"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A concrete place: the coordinator, a region, or a storage location.

    ``jurisdiction`` is None when unknown (then no ``jurisdiction:`` pattern matches it).
    ``region`` is the region the endpoint belongs to: the region itself, or the region
    that owns a storage location (None for the coordinator and unowned storage).
    """

    kind: EndpointKind
    name: str
    jurisdiction: str | None
    region: str | None = None

    def __post_init__(self) -> None:
        if self.kind is EndpointKind.COORDINATOR:
            if self.name != "coordinator" or self.region is not None:
                raise InvalidDestination("the coordinator endpoint has no name or region")
        else:
            _checked_name(self.kind.value, self.name)
        if self.kind is EndpointKind.REGION and self.region != self.name:
            raise InvalidDestination(f"region endpoint {self.name!r} must belong to itself")
        if self.region is not None:
            _checked_name("region", self.region)
        if self.jurisdiction is not None:
            validate_jurisdiction(self.jurisdiction)

    @classmethod
    def coordinator(cls, jurisdiction: str | None = None) -> Endpoint:
        return cls(EndpointKind.COORDINATOR, "coordinator", jurisdiction)

    @classmethod
    def of_region(cls, name: str, jurisdiction: str | None) -> Endpoint:
        return cls(EndpointKind.REGION, name, jurisdiction, name)

    @classmethod
    def of_storage(cls, name: str, jurisdiction: str | None, region: str | None = None) -> Endpoint:
        return cls(EndpointKind.STORAGE, name, jurisdiction, region)

    def __str__(self) -> str:
        if self.kind is EndpointKind.COORDINATOR:
            return "coordinator"
        return f"{self.kind.value}:{self.name}"

    def describe(self) -> str:
        """``storage:eu-ckpt (jurisdiction EU)``: the endpoint with where it lies."""
        where = self.jurisdiction if self.jurisdiction is not None else "unknown"
        return f"{self} (jurisdiction {where})"


class PatternKind(StrEnum):
    ANY = "*"
    COORDINATOR = "coordinator"
    REGION = "region"
    STORAGE = "storage"
    JURISDICTION = "jurisdiction"


@dataclass(frozen=True, slots=True)
class DestinationPattern:
    """One entry of an export rule's ``to:`` list (see the module docstring)."""

    kind: PatternKind
    value: str | None = None

    @classmethod
    def parse(cls, text: object) -> DestinationPattern:
        """Parse one pattern; raise :class:`InvalidDestination` naming the accepted forms."""
        if isinstance(text, DestinationPattern):
            return text
        if not isinstance(text, str):
            raise InvalidDestination(f"destination must be a string, got {text!r}")
        if text == "*":
            return cls(PatternKind.ANY)
        if text == "coordinator":
            return cls(PatternKind.COORDINATOR)
        prefix, sep, value = text.partition(":")
        if sep and prefix == "jurisdiction":
            return cls(PatternKind.JURISDICTION, validate_jurisdiction(value))
        if sep and prefix in ("region", "storage"):
            return cls(PatternKind(prefix), _checked_name(prefix, value))
        raise InvalidDestination(
            f"invalid destination {text!r}: use coordinator, region:NAME, storage:NAME, "
            "jurisdiction:CODE or *"
        )

    def matches(self, endpoint: Endpoint) -> bool:
        match self.kind:
            case PatternKind.ANY:
                return True
            case PatternKind.COORDINATOR:
                return endpoint.kind is EndpointKind.COORDINATOR
            case PatternKind.JURISDICTION:
                return endpoint.jurisdiction == self.value
            case PatternKind.REGION:
                return endpoint.kind is EndpointKind.REGION and endpoint.name == self.value
            case PatternKind.STORAGE:
                return endpoint.kind is EndpointKind.STORAGE and endpoint.name == self.value

    def __str__(self) -> str:
        if self.value is None:
            return self.kind.value
        return f"{self.kind.value}:{self.value}"


def parse_endpoint_reference(text: str) -> tuple[EndpointKind, str]:
    """Split ``coordinator``, ``region:NAME`` or ``storage:NAME`` into kind and name.

    Looking up jurisdictions is left to the caller (see ``PolicySet.endpoint``).
    """
    if text == "coordinator":
        return EndpointKind.COORDINATOR, "coordinator"
    prefix, sep, value = text.partition(":")
    if sep and prefix in ("region", "storage"):
        return EndpointKind(prefix), _checked_name(prefix, value)
    raise InvalidDestination(
        f"invalid endpoint {text!r}: use coordinator, region:NAME or storage:NAME"
    )


def _checked_name(what: str, value: str) -> str:
    try:
        return validate_name(what, value)
    except InvalidName as exc:
        raise InvalidDestination(str(exc)) from None
