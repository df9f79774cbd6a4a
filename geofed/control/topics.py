"""MQTT topics of one federation, built and parsed in one place.

Every topic lives under ``geofed/<federation>/``:

- ``regions/<region>/status``   retained status of a region's agent (Last Will: offline)
- ``regions/<region>/commands`` commands from the coordinator to one region
- ``jobs/<job>/round``          retained announcement of a job's current round
- ``events``                    the federation's event stream

Names are checked with :func:`geofed.types.validate_name`, so a name can never carry
``/``, ``+``, ``#`` or anything else that would change a topic's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from geofed.control.errors import TopicError
from geofed.types import InvalidName, validate_name

ROOT = "geofed"
#: Largest topic MQTT can carry (a two-byte length prefix).
MAX_TOPIC_BYTES = 65535


class TopicKind(StrEnum):
    """What a topic carries."""

    REGION_STATUS = "region_status"
    REGION_COMMANDS = "region_commands"
    JOB_ROUND = "job_round"
    EVENTS = "events"


_REGION_KINDS = frozenset({TopicKind.REGION_STATUS, TopicKind.REGION_COMMANDS})


@dataclass(frozen=True, slots=True)
class ParsedTopic:
    """A topic read back: its kind and the region or job it names (None for events)."""

    kind: TopicKind
    name: str | None = None

    @property
    def region(self) -> str:
        """The region of a region topic; :class:`TopicError` for any other kind."""
        if self.kind not in _REGION_KINDS or self.name is None:
            raise TopicError(f"a {self.kind} topic names no region")
        return self.name

    @property
    def job(self) -> str:
        """The job of a job topic; :class:`TopicError` for any other kind."""
        if self.kind is not TopicKind.JOB_ROUND or self.name is None:
            raise TopicError(f"a {self.kind} topic names no job")
        return self.name


# (first level, last level) of the three-level topics, by kind.
_NAMED_LAYOUT: dict[tuple[str, str], TopicKind] = {
    ("regions", "status"): TopicKind.REGION_STATUS,
    ("regions", "commands"): TopicKind.REGION_COMMANDS,
    ("jobs", "round"): TopicKind.JOB_ROUND,
}


@dataclass(frozen=True, slots=True)
class Topics:
    """Topic builder and parser for one federation: ``Topics("acme").events()``."""

    federation: str

    def __post_init__(self) -> None:
        validate_name("federation", self.federation)

    @property
    def prefix(self) -> str:
        """``geofed/<federation>``, the level every topic of the federation starts with."""
        return f"{ROOT}/{self.federation}"

    def region_status(self, region: str) -> str:
        return f"{self.prefix}/regions/{validate_name('region', region)}/status"

    def region_commands(self, region: str) -> str:
        return f"{self.prefix}/regions/{validate_name('region', region)}/commands"

    def job_round(self, job: str) -> str:
        return f"{self.prefix}/jobs/{validate_name('job', job)}/round"

    def events(self) -> str:
        return f"{self.prefix}/events"

    def all_region_status(self) -> str:
        """Subscription filter for every region's status."""
        return f"{self.prefix}/regions/+/status"

    def all_region_commands(self) -> str:
        """Subscription filter for the commands of every region (operators, audit)."""
        return f"{self.prefix}/regions/+/commands"

    def all_job_rounds(self) -> str:
        """Subscription filter for every job's round announcement."""
        return f"{self.prefix}/jobs/+/round"

    def everything(self) -> str:
        """Subscription filter for every topic of the federation (observers)."""
        return f"{self.prefix}/#"

    def parse(self, topic: str) -> ParsedTopic:
        """Turn a concrete topic of this federation back into its kind and name.

        Raises :class:`TopicError` naming what is wrong: another federation, an unknown
        layout, a wildcard, or a level that is not a valid name.
        """
        if not isinstance(topic, str):
            raise TopicError(f"topic must be a string, got {type(topic).__name__}")
        if len(topic.encode("utf-8", errors="surrogatepass")) > MAX_TOPIC_BYTES:
            raise TopicError(f"topic is longer than {MAX_TOPIC_BYTES} bytes")
        levels = topic.split("/")
        if len(levels) < 3 or levels[0] != ROOT:
            raise TopicError(f"not a geofed topic: {topic!r}")
        if levels[1] != self.federation:
            raise TopicError(
                f"topic {topic!r} belongs to federation {levels[1]!r}, not {self.federation!r}"
            )
        rest = levels[2:]
        if rest == ["events"]:
            return ParsedTopic(TopicKind.EVENTS)
        if len(rest) == 3 and (rest[0], rest[2]) in _NAMED_LAYOUT:
            kind = _NAMED_LAYOUT[(rest[0], rest[2])]
            what = "job" if kind is TopicKind.JOB_ROUND else "region"
            try:
                name = validate_name(what, rest[1])
            except InvalidName as exc:
                raise TopicError(f"topic {topic!r}: {exc}") from None
            return ParsedTopic(kind, name)
        raise TopicError(f"unknown geofed topic layout: {topic!r}")
