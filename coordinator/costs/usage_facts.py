"""What each job used, as the audit log records it (pure: entries in, facts out).

The audit log is the record (a restart forgets nothing, a backup carries it):

- ``job.admit``: the job runs from then and holds the GPUs its needs state, in the
  regions the admission chose (a capacity pass, ``to: running``) or in all its regions
  (a job admitted straight away); ``queued`` admissions hold nothing yet;
- ``job.regions`` (allowed): a region joins or leaves the job from then;
- ``job.preempt``, ``job.cancel``, ``job.fail``, and the ``round.publish`` that completes
  the job (``completed``): it holds nothing from then (pausing keeps the GPUs); an ending
  after the job ended changes nothing; for entries written before completions were
  recorded, the final state's time ends it (:meth:`UsageFold.ended`);
- ``delta.accept``: a region sent a delta of ``size`` bytes and ``tokens`` tokens;
- ``policy.global_update`` (allowed, to a region): the coordinator sent the region an
  update or a snapshot (``artifact``) of ``size`` bytes (a resumed download counts the
  whole artifact again);
- ``round.publish``: the chain stores ``update_size`` bytes (and ``snapshot_size`` more
  with a snapshot) in ``location``;
- ``checkpoint.snapshot`` (θ_0) and ``checkpoint.prune``: what the chain stores from, and
  until, when.

Entries written before a figure existed (a publication without ``update_size``, a
download without ``size``) count as nothing for it; :class:`JobUsage` says when it met
such entries.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator.state.audit import AuditEntry, entry_time

__all__ = ["ENDING_ACTIONS", "JobUsage", "Sent", "Span", "Stored", "UsageFold"]

#: Audited actions after which a job holds nothing.
ENDING_ACTIONS = frozenset({"job.preempt", "job.cancel", "job.fail"})

#: The residency decision of sending a region an update or a snapshot.
_DOWNLOAD = "policy.global_update"


@dataclass(frozen=True, slots=True)
class Span:
    """The job held its GPUs from ``start`` to ``end`` (None: still) in ``regions``."""

    start: float
    end: float | None
    regions: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Sent:
    """``size`` bytes between the coordinator and ``region`` at ``at``."""

    at: float
    region: str
    size: int
    tokens: int = 0


@dataclass(slots=True)
class Stored:
    """A checkpoint of the chain: ``size`` bytes in ``location`` from ``since`` to
    ``until`` (None: still stored)."""

    size: int
    location: str
    since: float
    until: float | None = None


@dataclass(slots=True)
class JobUsage:
    """One job's usage as :class:`UsageFold` read it."""

    job: str
    #: The regions the job names (where an admission does not say which it chose).
    regions: tuple[str, ...] = ()
    spans: list[Span] = field(default_factory=list)
    #: Deltas the regions sent (region to coordinator), once per round and region.
    uploads: list[Sent] = field(default_factory=list)
    #: Updates and snapshots the coordinator sent to the regions.
    downloads: list[Sent] = field(default_factory=list)
    #: The chain's checkpoints, by (kind, round) as the chain names them.
    stored: dict[tuple[str, int], Stored] = field(default_factory=dict)
    #: When each round was published.
    published: list[float] = field(default_factory=list)
    #: When entries lacked a figure a report needs (written by an older version).
    unsized: list[float] = field(default_factory=list)
    _open: Span | None = None
    _accepted: set[tuple[int, str]] = field(default_factory=set)

    def start(self, at: float, regions: tuple[str, ...] | None) -> None:
        if self._open is None:
            self._open = Span(at, None, self.regions if regions is None else regions)

    def change_region(self, at: float, region: str, action: str) -> None:
        """``region`` joins (``add``) or leaves (``remove``) the job at ``at``."""
        if action == "add" and region not in self.regions:
            self.regions = (*self.regions, region)
        elif action == "remove":
            self.regions = tuple(r for r in self.regions if r != region)
        held = self._open
        if held is None:
            return
        if action == "add" and region not in held.regions:
            regions: tuple[str, ...] = (*held.regions, region)
        elif action == "remove" and region in held.regions:
            regions = tuple(r for r in held.regions if r != region)
        else:
            return
        self.stop(at)
        self._open = Span(at, None, regions)

    def stop(self, at: float) -> None:
        if self._open is not None:
            self.spans.append(Span(self._open.start, max(at, self._open.start), self._open.regions))
            self._open = None

    def all_spans(self) -> list[Span]:
        """The closed spans and the open one."""
        return [*self.spans, *([self._open] if self._open is not None else [])]


class UsageFold:
    """Folds audit entries, oldest first, into each job's :class:`JobUsage`; ``regions``:
    each job's regions as its spec names them (before any change)."""

    def __init__(self, regions: Mapping[str, tuple[str, ...]]) -> None:
        self.jobs: dict[str, JobUsage] = {}
        self._regions = regions

    def fold(self, entries: Iterable[AuditEntry]) -> None:
        for entry in entries:
            if entry.job is None:
                continue
            at = entry_time(entry.time)
            if math.isnan(at):
                continue
            usage = self.jobs.get(entry.job)
            if usage is None:
                regions = self._regions.get(entry.job, ())
                usage = self.jobs[entry.job] = JobUsage(entry.job, regions)
            _fold_one(usage, entry, at)

    def ended(self, job: str, at: float) -> None:
        """``job`` reached a final state at ``at``: it holds nothing from then."""
        usage = self.jobs.get(job)
        if usage is not None:
            usage.stop(at)


def _fold_one(usage: JobUsage, entry: AuditEntry, at: float) -> None:
    action, details = entry.action, entry.details
    if action == "job.admit" and entry.verdict in ("allow", "ok"):
        if entry.verdict == "ok" and details.get("to") != "running":
            return
        if entry.verdict == "allow" and details.get("queued"):
            return
        usage.start(at, _names(details.get("regions")))
    elif action in ENDING_ACTIONS and entry.verdict != "deny":
        usage.stop(at)
    elif action == "job.regions" and entry.verdict == "allow" and entry.region is not None:
        usage.change_region(at, entry.region, str(details.get("action")))
    elif action == "delta.accept" and entry.round is not None and entry.region is not None:
        key = (entry.round, entry.region)
        if key not in usage._accepted:
            usage._accepted.add(key)
            usage.uploads.append(
                Sent(at, entry.region, _count(details.get("size")), _count(details.get("tokens")))
            )
    elif action == "round.publish" and entry.round is not None:
        _publish(usage, entry.round, details, at)
    elif action == "checkpoint.snapshot" and entry.round is not None:
        size = _size(details.get("size"))
        if size is not None:
            usage.stored[("snapshot", entry.round)] = Stored(size, str(details.get("location")), at)
        else:
            usage.unsized.append(at)
    elif action == _DOWNLOAD and entry.verdict == "allow" and entry.region is not None:
        size = _size(details.get("size"))
        if size is not None:
            usage.downloads.append(Sent(at, entry.region, size))
        else:
            usage.unsized.append(at)
    elif action == "checkpoint.prune":
        for item in details.get("removed") or ():
            if isinstance(item, list) and len(item) == 2 and _is_count(item[1]):
                stored = usage.stored.get((str(item[0]), item[1]))
                if stored is not None and stored.until is None:
                    stored.until = at


def _publish(usage: JobUsage, round_: int, details: Mapping[str, Any], at: float) -> None:
    usage.published.append(at)
    if details.get("completed") is True:
        usage.stop(at)
    size = _size(details.get("update_size"))
    if size is None:
        usage.unsized.append(at)
        return
    location = str(details.get("location"))
    usage.stored[("update", round_)] = Stored(size, location, at)
    snapshot = _size(details.get("snapshot_size"))
    if snapshot is not None:
        # The snapshot published with round r holds θ_{r+1}: the chain's round r + 1.
        usage.stored[("snapshot", round_ + 1)] = Stored(snapshot, location, at)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _size(value: Any) -> int | None:
    return value if _is_count(value) else None


def _count(value: Any) -> int:
    return value if _is_count(value) else 0


def _names(value: Any) -> tuple[str, ...] | None:
    if not isinstance(value, list):
        return None
    return tuple(str(item) for item in value)
