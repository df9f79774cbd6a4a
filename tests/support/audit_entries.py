"""Audit entries as the store writes them, for tests that fold the log (no chain: its
hashes are left empty, which a fold does not check)."""

from __future__ import annotations

import itertools
from typing import Any

from coordinator.state.audit import AuditEntry, format_time

__all__ = ["audit_entry"]

_seq = itertools.count(1)


def audit_entry(
    at: float,
    action: str,
    job: str | None,
    /,
    *,
    verdict: str = "ok",
    round_: int | None = None,
    region: str | None = None,
    seq: int | None = None,
    **details: Any,
) -> AuditEntry:
    """An entry of ``action`` on ``job`` at epoch second ``at`` (``seq``: the next);
    ``details`` may hold any key, ``action`` too (the positional ones are not keywords)."""
    return AuditEntry(
        seq=next(_seq) if seq is None else seq,
        time=format_time(at),
        actor="spiffe://acme/coordinator/main",
        action=action,
        verdict=verdict,
        job=job,
        round=round_,
        region=region,
        details=details,
        prev_hash="",
        hash="",
    )
