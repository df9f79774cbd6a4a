"""What the audit log tells the status page, folded entry by entry (pure).

The coordinator persists per-round facts only as audit entries: each accepted delta
(``delta.accept``: size, tokens, the region's training loss and the seconds it reported
training, encoding and uploading the round, when), each published
round (``round.publish``: included regions, stragglers, the snapshot if one was taken,
when), residency decisions (``policy.*``) and the job's other events. :class:`AuditDigest`
folds entries in order into bounded per-job histories, keeps the newest entries as the
log's tail, and verifies the hash chain incrementally (each entry's ``prev_hash`` against
the hash of the one before, so a page of new entries costs only its own hashing).

The timeline places a region's reported seconds back from the moment its delta was
accepted: upload, encoding and training; what remains since the round's start (the
previous publication) is the region's download, apply and start-up; then the wait until
the round was published. An agent that reports no timings shows one bar until
acceptance. The agent's ``round_timeline.jsonl`` has every phase.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from coordinator.state.audit import GENESIS_HASH, AuditEntry, entry_time, verify_chain

__all__ = [
    "MAX_EVENTS",
    "MAX_ROUNDS",
    "TAIL",
    "Accepted",
    "AuditDigest",
    "ChainStatus",
    "JobHistory",
    "RoundFacts",
]

#: Rounds kept per job (the newest); the charts show these.
MAX_ROUNDS: Final = 1000
#: Policy decisions and other job events kept per job (the newest).
MAX_EVENTS: Final = 10
#: Audit entries kept as the log's tail.
TAIL: Final = 30


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


@dataclass(slots=True)
class Accepted:
    """One region's accepted delta of a round."""

    at: float
    size: int
    tokens: int
    train_loss: float | None
    #: Seconds the region reported it trained, encoded and uploaded (None: not told).
    train_s: float | None = None
    encode_s: float | None = None
    upload_s: float | None = None


@dataclass(slots=True)
class RoundFacts:
    """What the log says about one round of a job."""

    round: int
    accepted: dict[str, Accepted] = field(default_factory=dict)
    published_at: float | None = None
    included: tuple[str, ...] = ()
    stragglers: tuple[str, ...] = ()
    snapshot: str | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A full snapshot of the job's parameters: θ_version, stored at ``at``."""

    version: int
    digest: str
    at: float


@dataclass(slots=True)
class JobHistory:
    """One job's rounds (newest :data:`MAX_ROUNDS`), snapshots and recent events."""

    job: str
    started_at: float | None = None  # admission, or θ_0's snapshot
    rounds: dict[int, RoundFacts] = field(default_factory=dict)
    snapshot: Snapshot | None = None
    policy: deque[AuditEntry] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    events: deque[AuditEntry] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    uploaded_bytes: int = 0
    deltas: int = 0

    def round(self, number: int) -> RoundFacts:
        facts = self.rounds.get(number)
        if facts is None:
            facts = self.rounds[number] = RoundFacts(number)
            if len(self.rounds) > MAX_ROUNDS:
                del self.rounds[min(self.rounds)]
        return facts

    def round_start(self, number: int) -> float | None:
        """When round ``number`` began: the previous round's publication (or the job's start)."""
        if number == 0:
            return self.started_at
        previous = self.rounds.get(number - 1)
        return previous.published_at if previous is not None else None

    def regions(self) -> list[str]:
        """Every region that delivered a delta in the kept rounds, sorted."""
        return sorted({region for facts in self.rounds.values() for region in facts.accepted})


@dataclass(frozen=True, slots=True)
class ChainStatus:
    """The audit chain as verified so far: ``ok`` over entries 1..``checked``."""

    ok: bool
    checked: int
    head_hash: str
    first_bad_seq: int | None = None
    reason: str = ""


#: Actions shown as a job's events (``job.*`` includes pauses, cancels and preemptions).
_JOB_EVENTS: Final = (
    "job.",
    "round.fail",
    "delta.reject",
    "checkpoint.prune",
    "export",
    "preempt",
)


@dataclass(slots=True)
class AuditDigest:
    """The folded audit log: per-job histories, the tail, and the chain's status."""

    jobs: dict[str, JobHistory] = field(default_factory=dict)
    tail: deque[AuditEntry] = field(default_factory=lambda: deque(maxlen=TAIL))
    chain: ChainStatus = field(default_factory=lambda: ChainStatus(True, 0, GENESIS_HASH))
    #: The seq of the newest entry folded; the next read starts after it.
    seq: int = 0

    def fold(self, entries: Iterable[AuditEntry]) -> None:
        """Take entries that follow :attr:`seq` (ascending): verify, then fold each."""
        batch = [entry for entry in entries if entry.seq > self.seq]
        if not batch:
            return
        if self.chain.ok:
            result = verify_chain(batch, prev_hash=self.chain.head_hash, start_seq=self.seq + 1)
            if result.ok:
                self.chain = ChainStatus(
                    True, self.chain.checked + result.checked, result.head_hash
                )
            else:
                self.chain = ChainStatus(
                    False,
                    self.chain.checked + result.checked,
                    result.head_hash,
                    result.first_bad_seq,
                    result.reason,
                )
        for entry in batch:
            self._fold_one(entry)
            self.tail.append(entry)
        self.seq = batch[-1].seq

    def _fold_one(self, entry: AuditEntry) -> None:
        if entry.job is None:
            return
        history = self.jobs.get(entry.job)
        if history is None:
            history = self.jobs[entry.job] = JobHistory(entry.job)
        action, details, at = entry.action, entry.details, entry_time(entry.time)
        if action == "job.admit" and history.started_at is None:
            history.started_at = at
        if action == "delta.accept" and entry.round is not None and entry.region is not None:
            _accept(history, entry.round, entry.region, details, at)
        elif action == "round.publish" and entry.round is not None:
            _publish(history, entry.round, details, at)
        elif action == "checkpoint.snapshot" and entry.round is not None:
            digest = str(details.get("bundle") or details.get("snapshot") or "")
            history.snapshot = Snapshot(entry.round, digest, at)
            if entry.round == 0 and history.started_at is None:
                history.started_at = at
        elif action.startswith("policy."):
            history.policy.append(entry)
        if action.startswith(_JOB_EVENTS):
            history.events.append(entry)


def _accept(
    history: JobHistory, round: int, region: str, details: Mapping[str, Any], at: float
) -> None:
    size = _number(details.get("size"))
    tokens = _number(details.get("tokens"))
    accepted = Accepted(
        at=at,
        size=int(size or 0),
        tokens=int(tokens or 0),
        train_loss=_number(details.get("train_loss")),
    )
    timings = details.get("timings")
    if isinstance(timings, Mapping):
        accepted.train_s = _seconds(timings.get("train_s"))
        accepted.encode_s = _seconds(timings.get("encode_s"))
        accepted.upload_s = _seconds(timings.get("upload_s"))
    facts = history.round(round)
    if region not in facts.accepted:
        history.uploaded_bytes += accepted.size
        history.deltas += 1
    facts.accepted[region] = accepted


def _seconds(value: Any) -> float | None:
    number = _number(value)
    return number if number is not None and number >= 0 else None


def _publish(history: JobHistory, round: int, details: Mapping[str, Any], at: float) -> None:
    facts = history.round(round)
    facts.published_at = at
    facts.included = _names(details.get("included"))
    facts.stragglers = _names(details.get("stragglers"))
    snapshot = details.get("snapshot")
    if isinstance(snapshot, str) and snapshot:
        facts.snapshot = snapshot
        # The snapshot published with round r holds θ_{r+1}.
        history.snapshot = Snapshot(round + 1, snapshot, at)


def _names(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        return ()
    return tuple(str(item) for item in value)
