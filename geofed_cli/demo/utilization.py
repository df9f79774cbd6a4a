"""The demo's compute utilization: read from each agent's round timeline.

Each agent writes one line per finished round into ``round_timeline.jsonl`` of its state
directory (:mod:`regional_agent.rounds.timeline`); a region's utilization is the union of
its workers' training intervals over the span from the first start to the last end
(:func:`regional_agent.handoff.utilization.compute_utilization`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from regional_agent.handoff.utilization import compute_utilization
from regional_agent.rounds.timeline import TimelineError, read_timeline

log = logging.getLogger(__name__)


def region_utilization(state_dir: Path, job: str) -> float | None:
    """The compute utilization of ``job`` in the agent state ``state_dir`` so far; None
    before a training interval is recorded (or if the timeline cannot be read)."""
    try:
        rounds = read_timeline(state_dir)
    except (TimelineError, OSError) as exc:
        log.warning("cannot read the round timeline of %s: %s", state_dir, exc)
        return None
    intervals = [
        (r.worker.start, r.worker.end) for r in rounds if r.job == job and r.worker is not None
    ]
    return compute_utilization(intervals).fraction


def utilization_by_region(
    agents_dir: Path, regions: Sequence[str], job: str
) -> dict[str, float | None]:
    """Region -> :func:`region_utilization` of its agent (state dir ``agents_dir/<region>``)."""
    return {region: region_utilization(agents_dir / region, job) for region in regions}


def format_utilization(values: dict[str, float | None]) -> str:
    """``0.83 0.79`` in region order; ``-`` where nothing is known yet."""
    return " ".join("-" if v is None else f"{v:.2f}" for v in values.values())
