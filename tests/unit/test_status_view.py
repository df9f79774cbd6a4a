"""What ``geofed status`` shows, from the coordinator's answers (pure rendering)."""

from __future__ import annotations

import io
from datetime import UTC, datetime
from typing import Any

from rich.console import Console

from geofed_cli.status_view import plain_text, rich_view, status_rows, trend

REGIONS: list[dict[str, Any]] = [
    {
        "region": "eu-west",
        "jurisdiction": "EU",
        "state": "training",
        "job": "llm",
        "round": 4,
        "train_loss": 2.5,
        "capacity": {"gpus": 2, "gpu_kind": "H100", "gpu_memory_gib": 80.0, "cpu_slots": 2},
        "in_use": {"gpus": 1, "cpu_slots": 0, "jobs": ["llm"]},
        "hardware": {"host": "gpu-node-1", "gpus": 2, "gpu_utilization": 0.5, "slowed_gpus": 1},
    },
    {
        "region": "us-east",
        "state": "offline",
        "capacity": None,
        "in_use": {"cpu_slots": 3},
        "hardware": {"host": "x", "gpus": -1},  # not a summary: shown as unknown
    },
]
JOBS: list[dict[str, Any]] = [
    {
        "job": "llm",
        "state": "running",
        "round": 4,
        "rounds": 10,
        "global_val_loss": {"round": 4, "value": 2.25},
        "checkpoint_location": "eu-ckpt",
        "val_loss_history": [{"round": r, "value": v} for r, v in enumerate([4.0, 3.0, 2.5, 2.25])],
    },
    {"job": "queued-one", "state": "paused", "round": 0, "rounds": 3},
]


def test_rows_show_every_region_and_job_and_what_is_unknown() -> None:
    rows = status_rows(REGIONS, JOBS)
    assert rows.regions[1] == (
        "eu-west",
        "EU",
        "training",
        "llm",
        "4",
        "2.5000",
        "2 GPU H100 80GiB, 2 slots",
        "1/2 GPU, 0/2 slots",
        "gpu-node-1: 2 GPUs 50% busy, 1 slowed down",
    )
    assert rows.regions[2] == (
        "us-east", "-", "offline", "-", "-", "-", "unknown", "3 slots", "-",
    )  # fmt: skip
    assert rows.jobs[1] == ("llm", "running", "4/10", "2.2500", "█▄▂▁", "eu-ckpt")
    assert rows.jobs[2] == ("queued-one", "paused", "0/3", "-", "-", "-")


def test_the_trend_is_low_where_the_loss_is_low_and_ignores_junk() -> None:
    assert trend([{"value": 1.0}, {"value": 1.0}]) == "▁▁"
    assert trend([{"value": 1.0}, {"value": "x"}, None, {"value": 3.0}]) == "▁█"
    assert trend(None) == "-"
    assert len(trend([{"value": float(i)} for i in range(40)])) == 16  # the last 16


def test_plain_text_is_aligned_and_the_live_view_names_a_failed_refresh() -> None:
    text = plain_text(status_rows(REGIONS, JOBS))
    lines = text.splitlines()
    assert lines[0].startswith("REGION   JURISDICTION  STATE")
    assert lines[1].startswith("eu-west  EU            training  llm  4      2.5000")
    assert "" in lines  # a blank line between the tables
    console = Console(file=io.StringIO(), width=120, record=True)
    updated = datetime(2026, 11, 24, 18, 0, tzinfo=UTC)
    console.print(rich_view(status_rows(REGIONS, JOBS), updated=updated, error="timed out"))
    shown = console.export_text()
    assert "eu-west" in shown
    assert "gpu-node-1: 2 GPUs 50% busy, 1 slowed down" in shown  # a table of its own
    assert "queued-one" in shown
    assert "last refresh failed: timed out" in shown
    assert "updated 2026-11-24T18:00:00+00:00" in shown


def test_names_with_markup_are_shown_as_they_are() -> None:
    regions = [{"region": "eu-west", "state": "online", "hardware": {"host": "evil[/]", "gpus": 1}}]
    console = Console(file=io.StringIO(), width=160, record=True)
    updated = datetime(2026, 11, 24, 18, 0, tzinfo=UTC)
    console.print(rich_view(status_rows(regions, []), updated=updated, error=None))
    assert "evil[/]: 1 GPU" in console.export_text()
