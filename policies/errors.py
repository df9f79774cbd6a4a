"""Exceptions of the region-policy engine and the located problems they carry.

Every loading problem names the file, the line and the key path it concerns, so an
operator can go straight to it: ``eu-west.yaml:12: exports.raw_data[0].to[1]: ...``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum


class Severity(StrEnum):
    """Errors make a policy set unusable; warnings point at likely mistakes."""

    ERROR = "error"
    WARNING = "warning"


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a policy (or placement) file, located by line and key path."""

    file: str
    line: int | None
    key: str
    message: str
    severity: Severity = Severity.ERROR

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        prefix = "warning: " if self.severity is Severity.WARNING else ""
        return f"{where}: {self.key}: {prefix}{self.message}"


class PolicyError(Exception):
    """Base class of every error the policy engine raises."""


class PolicyLoadError(PolicyError):
    """One or more policy files are unreadable, malformed or inconsistent.

    ``problems`` holds every error found (not only the first), in file order.
    """

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems: tuple[Problem, ...] = tuple(problems)
        if not self.problems:
            raise ValueError("PolicyLoadError needs at least one problem")
        first = self.problems[0]
        more = len(self.problems) - 1
        suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
        super().__init__(f"{first}{suffix}")


class InvalidDestination(PolicyError, ValueError):
    """A destination, source or pattern string does not follow the endpoint syntax."""


class UnknownEndpoint(PolicyError, LookupError):
    """An endpoint names a region or storage location no loaded policy declares."""


class PlacementError(PolicyError, ValueError):
    """A job placement is malformed (empty region, bad name, unknown storage)."""


class InvalidProvenance(PolicyError, ValueError):
    """A provenance (contributing regions and datasets) is malformed."""
