"""Mosquitto ACL for one federation's control topics, generated from its principals.

The broker maps a client certificate's CN to the MQTT username, and geofed CNs are
``<role>.<name>`` (:func:`geofed.pki.authority.mqtt_username`). A ``%u`` pattern cannot
fill the region level of ``regions/<region>/...`` with the role prefix in it, so every
principal gets an explicit ``user`` block; anything not granted is denied. Under the
federation's prefix ``geofed/<federation>/``:

============  =========================================================================
principal     may
============  =========================================================================
region        write (and read back) its own ``regions/<name>/status`` (Last Will too);
              read its own ``regions/<name>/commands``, ``jobs/+/round``, ``events``
coordinator   write ``jobs/#`` (round announcements), ``regions/+/commands``,
              ``events``; read ``regions/+/status`` and its own ``jobs/#``
observer      read everything under the prefix, and the broker's ``$SYS/#`` statistics
============  =========================================================================

Operators use the coordinator's HTTPS API and get no MQTT access. This module is pure:
names in, text out; ``geofed mqtt acl`` feeds it from the region policy files.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from geofed.control.topics import Topics
from geofed.pki.authority import mqtt_username
from geofed.types import Identity, InvalidName, Role

__all__ = [
    "Access",
    "AclError",
    "Principals",
    "TopicRule",
    "UserRules",
    "acl_rules",
    "render_acl",
]


class AclError(ValueError):
    """The principals cannot make a sound ACL (no region, a duplicate, a bad name)."""


class Access(StrEnum):
    """A Mosquitto ``topic`` access type."""

    READ = "read"
    WRITE = "write"
    READWRITE = "readwrite"


@dataclass(frozen=True, slots=True)
class TopicRule:
    """One ``topic <access> <pattern>`` line."""

    access: Access
    pattern: str

    def line(self) -> str:
        return f"topic {self.access.value} {self.pattern}"


@dataclass(frozen=True, slots=True)
class UserRules:
    """The grants of one username (a certificate CN)."""

    username: str
    grants: tuple[TopicRule, ...]


@dataclass(frozen=True, slots=True)
class Principals:
    """Who may use a federation's broker, by role; names are checked and sorted."""

    federation: str
    regions: tuple[str, ...]
    coordinators: tuple[str, ...] = ("main",)
    observers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        try:
            Topics(self.federation)
        except InvalidName as exc:
            raise AclError(str(exc)) from None
        for field, role in (
            ("regions", Role.REGION),
            ("coordinators", Role.COORDINATOR),
            ("observers", Role.OBSERVER),
        ):
            object.__setattr__(self, field, _checked(self.federation, role, getattr(self, field)))
        if not self.regions:
            raise AclError("no regions: the ACL would let no region publish its status")
        if not self.coordinators:
            raise AclError("no coordinator: nobody could announce rounds")


def _checked(federation: str, role: Role, names: Iterable[str]) -> tuple[str, ...]:
    if isinstance(names, str):
        raise AclError(f"{role.value} names must be a sequence of names, not the string {names!r}")
    seen: set[str] = set()
    for name in names:
        try:
            Identity(federation=federation, role=role, name=name)
        except InvalidName as exc:
            raise AclError(str(exc)) from None
        if name in seen:
            raise AclError(f"{role.value} {name!r} is listed twice")
        seen.add(name)
    return tuple(sorted(seen))


def _username(federation: str, role: Role, name: str) -> str:
    return mqtt_username(Identity(federation=federation, role=role, name=name))


def acl_rules(principals: Principals) -> tuple[UserRules, ...]:
    """Every username's grants: coordinators, then regions, then observers, by name."""
    topics = Topics(principals.federation)
    federation = principals.federation
    rules: list[UserRules] = []
    grants: tuple[TopicRule, ...]
    for name in principals.coordinators:
        grants = (
            TopicRule(Access.READWRITE, f"{topics.prefix}/jobs/#"),
            TopicRule(Access.WRITE, topics.all_region_commands()),
            TopicRule(Access.WRITE, topics.events()),
            TopicRule(Access.READ, topics.all_region_status()),
        )
        rules.append(UserRules(_username(federation, Role.COORDINATOR, name), grants))
    for name in principals.regions:
        grants = (
            TopicRule(Access.READWRITE, topics.region_status(name)),
            TopicRule(Access.READ, topics.region_commands(name)),
            TopicRule(Access.READ, topics.all_job_rounds()),
            TopicRule(Access.READ, topics.events()),
        )
        rules.append(UserRules(_username(federation, Role.REGION, name), grants))
    for name in principals.observers:
        grants = (TopicRule(Access.READ, topics.everything()), TopicRule(Access.READ, "$SYS/#"))
        rules.append(UserRules(_username(federation, Role.OBSERVER, name), grants))
    return tuple(rules)


def render_acl(principals: Principals, *, source: str | None = None) -> str:
    """The text of a Mosquitto ``acl_file``; ``source`` is named in the header comment.

    The output depends only on the principals (no timestamp), so a regenerated file
    diffs cleanly against the deployed one.
    """
    header = [
        f"# Mosquitto ACL for geofed federation {principals.federation!r}.",
        "# Generated by `geofed mqtt acl`; edit the region policies and regenerate instead.",
    ]
    if source is not None:
        if "\n" in source or "\r" in source:
            raise AclError(f"source {source!r} must be one line: it goes into a comment")
        header.append(f"# Regions from: {source}")
    header += [
        "# Usernames are client certificate CNs (<role>.<name>); anything not granted",
        "# here is denied. Reload the broker after replacing this file (SIGHUP).",
    ]
    blocks = [
        "\n".join([f"user {rules.username}", *(grant.line() for grant in rules.grants)])
        for rules in acl_rules(principals)
    ]
    return "\n".join(header) + "\n\n" + "\n\n".join(blocks) + "\n"
