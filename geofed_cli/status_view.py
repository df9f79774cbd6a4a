"""What ``geofed status`` shows: the federation's regions and jobs, as rows.

:func:`status_rows` turns the coordinator's ``GET /v1/regions`` and ``GET /v1/jobs``
answers into the rows of both tables; :func:`plain_text` prints them as aligned text (a
pipe, a log, ``--watch`` when stdout is not a terminal) and :func:`rich_view` as a live
terminal view (``--watch`` on a terminal). Pure: no I/O, the time passed in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from geofed.control import HardwareSummary

__all__ = ["StatusRows", "plain_text", "rich_view", "status_rows"]

REGION_HEADER = (
    "REGION",
    "JURISDICTION",
    "STATE",
    "JOB",
    "ROUND",
    "TRAIN_LOSS",
    "CAPACITY",
    "IN_USE",
    "HARDWARE",
)
JOB_HEADER = ("JOB", "STATE", "ROUND", "VAL_LOSS", "LOSS_TREND", "LOCATION")
#: Eight levels, lowest to highest, for a job's validation-loss trend.
_SPARKS = "▁▂▃▄▅▆▇█"
_TREND_POINTS = 16


@dataclass(frozen=True, slots=True)
class StatusRows:
    """Both tables' rows (header first)."""

    regions: tuple[tuple[str, ...], ...]
    jobs: tuple[tuple[str, ...], ...]


def status_rows(
    regions: Sequence[Mapping[str, Any]], jobs: Sequence[Mapping[str, Any]]
) -> StatusRows:
    """The rows of the regions and jobs tables, from the coordinator's answers."""
    region_rows = [REGION_HEADER]
    for region in regions:
        loss = region.get("train_loss")
        region_rows.append(
            (
                str(region.get("region", "?")),
                str(region.get("jurisdiction") or "-"),
                str(region.get("state", "unknown")),
                str(region.get("job") or "-"),
                _text(region.get("round")),
                f"{loss:.4f}" if _number(loss) else "-",
                capacity_text(region.get("capacity")),
                in_use_text(region.get("in_use"), region.get("capacity")),
                hardware_text(region.get("hardware")),
            )
        )
    job_rows = [JOB_HEADER]
    for job in jobs:
        loss = job.get("global_val_loss")
        value = loss.get("value") if isinstance(loss, Mapping) else None
        job_rows.append(
            (
                str(job.get("job", "?")),
                str(job.get("state", "unknown")),
                f"{job.get('round', '-')}/{job.get('rounds', '-')}",
                f"{value:.4f}" if _number(value) else "-",
                trend(job.get("val_loss_history")),
                str(job.get("checkpoint_location") or "-"),
            )
        )
    return StatusRows(tuple(region_rows), tuple(job_rows))


def hardware_text(summary: object) -> str:
    """The region's node as its status reported it (``-``: not reported)."""
    if not isinstance(summary, Mapping):
        return "-"
    try:
        return HardwareSummary.model_validate(summary).describe()
    except ValidationError:
        return "-"


def capacity_text(capacity: object) -> str:
    """``2 GPU NVIDIA H100 80GiB, 2 slots``; ``unknown`` (treated as unlimited) when absent."""
    if not isinstance(capacity, Mapping):
        return "unknown"
    parts = []
    gpus = capacity.get("gpus")
    if _number(gpus) and gpus:
        kind = capacity.get("gpu_kind")
        memory = capacity.get("gpu_memory_gib")
        gpu = f"{gpus} GPU"
        gpu += f" {kind}" if kind else ""
        gpu += f" {memory:g}GiB" if _number(memory) and memory else ""
        parts.append(gpu)
    slots = capacity.get("cpu_slots")
    parts.append(f"{slots if _number(slots) else 0} slots")
    return ", ".join(parts)


def in_use_text(in_use: object, capacity: object) -> str:
    """``1/2 slots`` (of a known capacity) or ``1 slots``, with GPUs when any: what jobs hold."""
    if not isinstance(in_use, Mapping):
        return "-"
    known = capacity if isinstance(capacity, Mapping) else {}
    parts = []
    for key, unit in (("gpus", "GPU"), ("cpu_slots", "slots")):
        used, total = in_use.get(key, 0), known.get(key)
        if key == "gpus" and not used and not total:
            continue
        parts.append(f"{used}/{total} {unit}" if _number(total) else f"{used} {unit}")
    return ", ".join(parts)


def trend(history: object) -> str:
    """The last validation losses as a sparkline (lowest loss, lowest bar); "-" if none."""
    if not isinstance(history, Sequence):
        return "-"
    values = [
        float(point["value"])
        for point in history
        if isinstance(point, Mapping) and _number(point.get("value"))
    ][-_TREND_POINTS:]
    if not values:
        return "-"
    low, high = min(values), max(values)
    span = high - low
    if span == 0:
        return _SPARKS[0] * len(values)
    top = len(_SPARKS) - 1
    return "".join(_SPARKS[round((v - low) / span * top)] for v in values)


def plain_text(rows: StatusRows) -> str:
    """Both tables as aligned text, a blank line between them."""
    return _aligned(rows.regions) + "\n\n" + _aligned(rows.jobs) + "\n"


def rich_view(rows: StatusRows, *, updated: datetime, error: str | None = None) -> RenderableType:
    """Both tables for a live terminal view, with when they were read (and what failed)."""
    # The hardware lines are long: a table of their own, so the regions' columns fit.
    at = rows.regions[0].index("HARDWARE")
    regions = [row[:at] + row[at + 1 :] for row in rows.regions]
    hardware = [("REGION", "HARDWARE")] + [(r[0], r[at]) for r in rows.regions[1:] if r[at] != "-"]
    parts: list[RenderableType] = [_table("Regions", regions)]
    if len(hardware) > 1:
        parts.append(_table("Hardware", hardware))
    parts.append(_table("Jobs", rows.jobs))
    footer = Text(f"updated {updated.isoformat(timespec='seconds')} — Ctrl-C to stop", style="dim")
    if error is not None:
        parts.append(Text(f"last refresh failed: {error}", style="bold red"))
    parts.append(footer)
    return Group(*parts)


def _table(title: str, rows: Sequence[tuple[str, ...]]) -> Table:
    table = Table(title=title, title_justify="left", expand=False)
    for name in rows[0]:
        table.add_column(name, no_wrap=True)
    for row in rows[1:]:
        # Text, not markup: a name or host with brackets is shown, never interpreted.
        table.add_row(*(Text(cell) for cell in row))
    return table


def _aligned(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _text(value: object) -> str:
    return "-" if value is None else str(value)
