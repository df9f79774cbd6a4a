"""Folding the audit log for the status page: per-round facts, bounds, chain status."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from coordinator.api.ui.history import MAX_EVENTS, MAX_ROUNDS, TAIL, AuditDigest
from coordinator.state.audit import (
    GENESIS_HASH,
    AuditEntry,
    AuditEvent,
    AuditVerdict,
    chained_entry,
    validated_fields,
)
from geofed.types import Identity, Role

COORD = Identity("fed", Role.COORDINATOR, "main")
T0 = 1_700_000_000.0


class Log:
    """Entries chained as a store chains them, at a clock that ticks 1 s per entry."""

    def __init__(self) -> None:
        self.entries: list[AuditEntry] = []

    def add(self, action: str, **fields: Any) -> AuditEntry:
        verdict = fields.pop("verdict", AuditVerdict.OK)
        event = AuditEvent(
            actor=fields.pop("actor", COORD), action=action, verdict=verdict, **fields
        )
        prev = self.entries[-1].hash if self.entries else GENESIS_HASH
        entry = chained_entry(
            validated_fields(event), len(self.entries) + 1, prev, T0 + len(self.entries)
        )
        self.entries.append(entry)
        return entry


def _round(log: Log, number: int, losses: dict[str, float], *, snapshot: str | None = None) -> None:
    for region, loss in losses.items():
        log.add(
            "delta.accept",
            job="llm",
            round=number,
            region=region,
            verdict=AuditVerdict.ALLOW,
            details={"size": 1000, "tokens": 64, "train_loss": loss},
        )
    log.add(
        "round.publish",
        job="llm",
        round=number,
        details={"included": sorted(losses), "stragglers": [], "snapshot": snapshot},
    )


def _job(log: Log) -> None:
    log.add("job.admit", job="llm", details={})
    log.add("checkpoint.snapshot", job="llm", round=0, details={"snapshot": "aa" * 32})


def test_rounds_losses_bytes_and_the_timeline_come_from_the_log() -> None:
    log = Log()
    _job(log)
    _round(log, 0, {"eu-west": 5.0, "us-east": 5.2})
    _round(log, 1, {"eu-west": 4.0}, snapshot="bb" * 32)
    digest = AuditDigest()
    digest.fold(log.entries)
    history = digest.jobs["llm"]
    assert history.regions() == ["eu-west", "us-east"]
    assert history.rounds[0].accepted["us-east"].train_loss == 5.2
    assert history.rounds[1].included == ("eu-west",)
    assert (history.uploaded_bytes, history.deltas) == (3000, 3)
    assert history.round_start(0) == T0  # admission
    assert history.round_start(1) == history.rounds[0].published_at == T0 + 4
    assert history.rounds[1].accepted["eu-west"].at == T0 + 5
    assert history.snapshot is not None
    assert (history.snapshot.version, history.snapshot.digest) == (2, "bb" * 32)
    assert digest.chain.ok
    assert digest.chain.checked == len(log.entries)


def test_folding_is_incremental_and_ignores_what_it_has_seen() -> None:
    log = Log()
    _job(log)
    _round(log, 0, {"eu-west": 5.0})
    digest = AuditDigest()
    digest.fold(log.entries)
    _round(log, 1, {"eu-west": 4.0})
    digest.fold(log.entries)  # the old entries again, and the new ones
    assert digest.seq == len(log.entries)
    assert digest.jobs["llm"].deltas == 2
    assert digest.chain.ok
    assert digest.chain.checked == len(log.entries)


def test_a_tampered_entry_breaks_the_chain_where_it_is() -> None:
    log = Log()
    _job(log)
    _round(log, 0, {"eu-west": 5.0})
    digest = AuditDigest()
    digest.fold(log.entries[:2])
    bad = dataclasses.replace(log.entries[2], details={"size": 1, "train_loss": 0.1})
    digest.fold([bad, *log.entries[3:]])
    assert not digest.chain.ok
    assert digest.chain.first_bad_seq == 3
    assert "does not match its hash" in digest.chain.reason
    assert digest.seq == len(log.entries)  # still shown, flagged


def test_a_missing_entry_breaks_the_chain() -> None:
    log = Log()
    _job(log)
    _round(log, 0, {"eu-west": 5.0})
    digest = AuditDigest()
    digest.fold([log.entries[0], *log.entries[2:]])
    assert not digest.chain.ok
    assert digest.chain.first_bad_seq == 2


def _many(count: int) -> Iterator[AuditEntry]:
    log = Log()
    _job(log)
    for number in range(count):
        _round(log, number, {"eu-west": 1.0})
        log.add(
            "policy.model_delta",
            job="llm",
            round=number,
            region="eu-west",
            verdict=AuditVerdict.ALLOW,
            details={"reason": "ok"},
        )
    yield from log.entries


def test_memory_is_bounded() -> None:
    digest = AuditDigest()
    entries = list(_many(MAX_ROUNDS + 50))
    for start in range(0, len(entries), 1000):
        digest.fold(entries[start : start + 1000])
    history = digest.jobs["llm"]
    assert len(history.rounds) == MAX_ROUNDS
    assert min(history.rounds) == 50
    assert len(history.policy) == MAX_EVENTS
    assert len(digest.tail) == TAIL
    assert digest.tail[-1].seq == len(entries)
    assert digest.chain.ok
    assert digest.chain.checked == len(entries)


def test_unreadable_details_do_not_break_the_fold() -> None:
    log = Log()
    log.add(
        "delta.accept",
        job="llm",
        round=0,
        region="eu-west",
        details={"size": "big", "train_loss": None},
    )
    log.add("round.publish", job="llm", round=0, details={"included": "eu-west"})
    digest = AuditDigest()
    digest.fold(log.entries)
    facts = digest.jobs["llm"].rounds[0]
    assert facts.accepted["eu-west"].train_loss is None
    assert facts.accepted["eu-west"].size == 0
    assert facts.included == ()


def test_the_seconds_a_region_reported_are_kept_and_nonsense_is_dropped() -> None:
    log = Log()
    for region, timings in (
        ("eu-west", {"train_s": 12.5, "encode_s": 0.5, "upload_s": 2.0}),
        ("us-east", {"train_s": -1, "encode_s": "fast", "upload_s": None}),
        ("ap-south", None),
    ):
        details: dict[str, Any] = {"size": 1000, "tokens": 64, "train_loss": 2.0}
        if timings is not None:
            details["timings"] = timings
        log.add(
            "delta.accept",
            job="llm",
            round=0,
            region=region,
            verdict=AuditVerdict.ALLOW,
            details=details,
        )
    digest = AuditDigest()
    digest.fold(log.entries)
    accepted = digest.jobs["llm"].rounds[0].accepted
    eu = accepted["eu-west"]
    assert (eu.train_s, eu.encode_s, eu.upload_s) == (12.5, 0.5, 2.0)
    for region in ("us-east", "ap-south"):
        told = accepted[region]
        assert (told.train_s, told.encode_s, told.upload_s) == (None, None, None), region
