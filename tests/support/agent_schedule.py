"""Round announcements as region ``eu-west``'s schedule receives them.

Shared by the agent's scheduling and rollback tests (``tests/unit/test_agent_schedule.py``,
``tests/unit/test_agent_rollback.py``).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from geofed.codec_params import CodecParams
from geofed.control import RoundAnnouncement

T0 = datetime(2026, 1, 1, tzinfo=UTC)
REGION = "eu-west"


def announce(
    job: str = "llm", round_: int = 1, state: str = "open", **extra: Any
) -> RoundAnnouncement:
    """Round ``round_`` of ``job`` for this region and us-east; ``extra`` replaces fields."""
    fields: dict[str, Any] = {
        "job": job,
        "round": round_,
        "base_round": round_,
        "base_hash": f"{round_:064x}",
        "update_url": f"/v1/jobs/{job}/rounds/{round_ - 1}/update" if round_ else None,
        "update_digest": "ab" * 32 if round_ else None,
        "participants": (REGION, "us-east"),
        "min_regions": 1,
        "deadline": T0 + timedelta(minutes=5),
        "deadline_s": 300.0,
        "inner_steps": 5,
        "codec": CodecParams(),
        "task": "tests.support.tiny_task:TinyTask",
        "seed": 0,
        "state": state,
        "sent_at": T0 + timedelta(seconds=round_),
    }
    fields.update(extra)
    return RoundAnnouncement(**fields)
