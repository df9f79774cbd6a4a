"""What a daemon's reload (SIGHUP) changed: shared, pure logic of both daemons' reloads.

A reload reads the configuration file again with everything it names, checks it all,
and then either applies what can change in a running daemon (the region policies, the
trust bundle's revocations, ``log_level``) or, if anything is unusable, changes nothing.
Keys that only a restart can apply (addresses, state directories, credentials...) are
reported, not applied. :func:`changed_keys` finds them; :class:`ReloadReport` is what a
reload logs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel

from geofed.pki.trust import TrustBundle

__all__ = [
    "LOG_LEVELS",
    "LogLevel",
    "ReloadReport",
    "apply_log_level",
    "changed_keys",
    "describe_bundle_reload",
]

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
LOG_LEVELS: tuple[LogLevel, ...] = ("DEBUG", "INFO", "WARNING", "ERROR")


def changed_keys(old: BaseModel, new: BaseModel, *, ignore: Iterable[str] = ()) -> list[str]:
    """Dotted keys whose values differ between two configurations (``ignore``d left out).

    A key below an ignored one is ignored too; list items compare as whole values.
    """
    skipped = frozenset(ignore)
    found: list[str] = []
    _diff(old.model_dump(mode="json"), new.model_dump(mode="json"), "", skipped, found)
    return found


def _diff(old: object, new: object, prefix: str, skipped: frozenset[str], found: list[str]) -> None:
    if prefix in skipped:
        return
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        for key in sorted({*old, *new}, key=str):
            dotted = f"{prefix}.{key}" if prefix else str(key)
            _diff(old.get(key), new.get(key), dotted, skipped, found)
    elif old != new:
        found.append(prefix or "(the whole file)")


@dataclass
class ReloadReport:
    """What one reload did: applied, left for a restart, or refused (then nothing changed)."""

    reloaded: list[str] = field(default_factory=list)
    needs_restart: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.refused

    def log(self, logger: logging.Logger, what: str) -> None:
        """One line per outcome: the operator greps for ``reload``."""
        if self.refused:
            logger.error("%s reload refused, nothing changed: %s", what, "; ".join(self.refused))
            return
        logger.info(
            "%s reloaded: %s", what, "; ".join(self.reloaded) if self.reloaded else "nothing"
        )
        if self.needs_restart:
            logger.warning(
                "%s reload: these changes need a restart and are not in force: %s",
                what,
                "; ".join(self.needs_restart),
            )


def apply_log_level(level: LogLevel | None, default: int) -> str:
    """Set the root logger to ``level`` (None: ``default``, the command line's); describe it."""
    value = default if level is None else logging.getLevelNamesMapping()[level]
    logging.getLogger().setLevel(value)
    return f"log level {logging.getLevelName(value)}"


def describe_bundle_reload(old: TrustBundle, new: TrustBundle) -> tuple[str, str | None]:
    """What replacing ``old`` by ``new`` applies now, and what waits for a restart (or None).

    Revocations apply to the next request and artifact; the CA list of a TLS context is
    fixed when the daemon starts.
    """
    added = len(new.revoked_serials - old.revoked_serials)
    removed = len(old.revoked_serials - new.revoked_serials)
    applied = (
        f"trust bundle ({len(new.revoked_serials)} revoked serials, "
        f"{added} added, {removed} removed)"
    )
    if old.ca_pem() == new.ca_pem():
        return applied, None
    return applied, (
        "trust bundle authorities changed: certificates of a removed authority are refused "
        "now, TLS handshakes keep the authorities they started with until a restart"
    )
