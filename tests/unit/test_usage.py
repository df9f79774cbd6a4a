"""GPU run spans for GPU-hour quotas, kept live and rebuilt from the audit log."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from coordinator.jobs.usage import RunLedger
from coordinator.scheduling import RunInterval
from coordinator.state.audit import AuditEntry
from tests.support.audit_entries import audit_entry


def _entry(seq: int, at: float, action: str, verdict: str, job: str, **details: Any) -> AuditEntry:
    return audit_entry(at, action, job, verdict=verdict, seq=seq, **details)


def test_live_spans_open_close_and_ignore_jobs_without_gpus() -> None:
    ledger = RunLedger()
    ledger.started("a", "vision", 2, 100.0)
    ledger.started("a", "vision", 2, 150.0)  # already open: kept as it was
    ledger.started("cpu", "vision", 0, 100.0)
    ledger.stopped("a", 200.0)
    ledger.stopped("cpu", 200.0)
    ledger.started("a", "vision", 2, 300.0)
    assert ledger.intervals() == [
        RunInterval("vision", 2, 100.0, 200.0),
        RunInterval("vision", 2, 300.0, None),
    ]
    assert ledger.intervals(since=250.0) == [RunInterval("vision", 2, 300.0, None)]
    ledger.forget_before(250.0)
    assert ledger.intervals() == [RunInterval("vision", 2, 300.0, None)]


def test_replay_from_the_audit_log() -> None:
    entries = [
        _entry(1, 100.0, "job.admit", "allow", "a", queued=True),  # holds nothing yet
        _entry(2, 110.0, "job.admit", "ok", "a", to="running", regions=["eu", "us"]),
        _entry(3, 120.0, "job.preempt", "ok", "a"),
        _entry(4, 130.0, "job.admit", "ok", "a", to="running", regions=["eu"]),
        _entry(5, 140.0, "job.fail", "error", "a"),
        _entry(6, 150.0, "job.admit", "ok", "b", to="running", regions=["eu", "us"]),
        _entry(7, 155.0, "job.cancel", "deny", "b"),  # refused: b runs on
        _entry(8, 160.0, "job.admit", "ok", "c", to="running", regions=["eu", "us"]),
        _entry(9, 170.0, "job.admit", "ok", "other", to="running", regions=["eu"]),
    ]
    ledger = RunLedger()
    ledger.replay(
        entries,
        teams={"a": "vision", "b": "nlp", "c": "nlp"},
        regions={"a": ("eu", "us"), "b": ("eu", "us"), "c": ("eu", "us")},
        gpus={"a": {"eu": 1, "us": 3}, "b": {"eu": 2, "us": 2}, "c": {"eu": 1, "us": 1}},
        finished={"c": 180.0},  # completed: no audit entry, its record's last update
    )
    assert sorted(ledger.intervals(), key=lambda i: i.start) == [
        RunInterval("vision", 4, 110.0, 120.0),
        RunInterval("vision", 1, 130.0, 140.0),
        RunInterval("nlp", 4, 150.0, None),
        RunInterval("nlp", 2, 160.0, 180.0),
    ]


def test_replay_follows_a_region_that_joined() -> None:
    joined = replace(_entry(2, 150.0, "job.regions", "allow", "d"), region="us")
    entries = [
        _entry(1, 100.0, "job.admit", "ok", "d", to="running", regions=["eu"]),
        replace(joined, details={"action": "add"}),
        _entry(3, 200.0, "job.cancel", "ok", "d"),
    ]
    ledger = RunLedger()
    ledger.replay(
        entries,
        teams={"d": "nlp"},
        regions={"d": ("eu",)},
        gpus={"d": {"eu": 4, "us": 4}},  # us holds what the spec needs there once it joins
        finished={},
    )
    assert ledger.intervals() == [
        RunInterval("nlp", 4, 100.0, 150.0),
        RunInterval("nlp", 8, 150.0, 200.0),
    ]
