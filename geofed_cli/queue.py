"""``geofed queue``: the jobs waiting for capacity (in queue order) and those running.

Reads ``GET /v1/queue`` with the connection settings of ``geofed job`` (flags, else
``GEOFED_*``; see :mod:`geofed_cli.jobs`). :func:`queue_rows` and :func:`queue_text`
render the answer (pure). Exit codes: 0 success, 1 refused or unreachable, 2 usage error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from geofed.api_paths import ApiPaths
from geofed_cli.jobs import _connection_arguments, estimate_text, show

__all__ = ["QUEUE_HEADER", "queue_rows", "queue_text", "register", "wait_text"]

QUEUE_HEADER = ("POSITION", "JOB", "STATE", "PRIORITY", "TEAM", "WAIT", "ESTIMATE", "REASON")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "queue",
        help="show the jobs waiting for capacity and those running",
        description="Show the coordinator's queue: jobs waiting for capacity, in the order "
        "they will be considered, with why each waits and for how long, then the jobs "
        "running. Exit codes: 0 success, 1 refused or unreachable, 2 usage error.",
    )
    _connection_arguments(parser)
    parser.set_defaults(handler=_queue)


def _queue(args: argparse.Namespace) -> int:
    return show(
        args,
        ApiPaths.QUEUE,
        lambda body: sys.stdout.write(queue_text(queue_rows(body.get("jobs", [])))),
    )


def queue_rows(jobs: Sequence[Mapping[str, Any]]) -> tuple[tuple[str, ...], ...]:
    """The table's rows (header first): waiting jobs by position, then the others."""
    rows = [QUEUE_HEADER]
    for job in jobs:
        position = job.get("position")
        rows.append(
            (
                str(position) if position is not None else "-",
                str(job.get("job", "?")),
                str(job.get("state", "unknown")),
                str(job.get("priority") or "-"),
                str(job.get("team") or "-"),
                wait_text(job.get("wait_s")),
                estimate_text(job.get("cost_estimate")),
                str(job.get("reason") or "-"),
            )
        )
    return tuple(rows)


def wait_text(seconds: object) -> str:
    """``42s``, ``3m05s``, ``2h07m``; ``-`` when not waiting."""
    if not isinstance(seconds, int | float) or isinstance(seconds, bool):
        return "-"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def queue_text(rows: Sequence[tuple[str, ...]]) -> str:
    """The rows as aligned text; the last column (the reason) is not padded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return (
        "\n".join(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in rows
        )
        + "\n"
    )
