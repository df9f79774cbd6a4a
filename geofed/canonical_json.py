"""Deterministic JSON bytes: what is signed and hashed (manifests, lineage, job specs)."""

from __future__ import annotations

import json

__all__ = ["canonical_json"]


def canonical_json(value: object) -> bytes:
    """``value`` as deterministic JSON bytes: sorted keys, no whitespace, UTF-8, no NaN."""
    text = json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )
    return text.encode("utf-8")
