"""Grants: which identities an authority may issue, as globs on ``<role>/<name>``.

``region/eu-*`` lets an authority issue any region whose name starts with ``eu-``;
``*/*`` lets it issue anything in the federation. Role and name are matched separately
(case-sensitively), so a ``*`` never spans the slash.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatchcase

from geofed.types import Identity, Role

_PART_RE = re.compile(r"^[a-z0-9*?\[\]!-]{1,63}$")


class InvalidGrant(ValueError):
    """A grant pattern is not ``<role-glob>/<name-glob>`` or can never match."""


@dataclass(frozen=True, slots=True)
class Grant:
    """One ``<role-glob>/<name-glob>`` pattern."""

    role: str
    name: str

    @classmethod
    def parse(cls, text: str) -> Grant:
        """Parse ``text``; raise :class:`InvalidGrant` naming what is wrong."""
        parts = text.split("/")
        if len(parts) != 2:
            raise InvalidGrant(f"grant {text!r} must be <role>/<name>, e.g. 'region/eu-*'")
        role, name = parts
        for part in parts:
            if not _PART_RE.fullmatch(part):
                raise InvalidGrant(
                    f"grant {text!r}: {part!r} may use only lowercase letters, digits, "
                    "'-' and the glob characters * ? [ ] !"
                )
        if not any(fnmatchcase(r.value, role) for r in Role):
            roles = ", ".join(r.value for r in Role)
            raise InvalidGrant(f"grant {text!r}: {role!r} matches no role ({roles})")
        return cls(role=role, name=name)

    def allows(self, identity: Identity) -> bool:
        return fnmatchcase(identity.role.value, self.role) and fnmatchcase(identity.name, self.name)

    def __str__(self) -> str:
        return f"{self.role}/{self.name}"
