"""``geofed usage``: what each job and team used and cost over a period (showback).

Reads ``GET /v1/usage`` with the connection settings of ``geofed job`` (flags, else
``GEOFED_*``; see :mod:`geofed_cli.jobs`) and prints a table per job and per team, or
CSV (``--csv``), or the coordinator's JSON (``--json``). ``--since``/``--until`` take a
date (``2026-11-01``), a UTC time (``2026-11-01T12:00``, or with an offset) or a span
back from now (``7d``, ``12h``, ``30m``); the default is the last 30 days. The rendering
(:func:`usage_text`, :func:`usage_csv`) and :func:`parse_when` are pure.
Exit codes: 0 success, 1 refused or unreachable, 2 usage error.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
import time
import urllib.parse
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

from geofed.api_paths import ApiPaths
from geofed_cli.jobs import _connection_arguments, show
from geofed_cli.queue import queue_text

__all__ = ["CSV_COLUMNS", "parse_when", "register", "usage_csv", "usage_text"]

_SPAN = re.compile(r"^(\d+(?:\.\d+)?)([dhm])$")
_UNIT_S: Final = {"d": 86400, "h": 3600, "m": 60}

#: The columns of ``--csv``: one row per job, then one per team (``scope``).
CSV_COLUMNS: Final = (
    "scope", "team", "job", "gpu_hours", "gpu_cost", "upload_gb", "upload_cost",
    "download_gb", "download_cost", "wan_gb", "storage_gb_months", "storage_cost", "tokens",
    "rounds", "total", "per_million_tokens", "currency", "unpriced",
)  # fmt: skip


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "usage",
        help="show what each job and team used and cost over a period",
        description="Show each job's GPU-hours, WAN and checkpoint storage over a period, "
        "priced by the coordinator's price table (prices:), per job and per team. Use the "
        "table does not price is counted and named, never priced at zero. Exit codes: 0 "
        "success, 1 refused or unreachable, 2 usage error.",
    )
    parser.add_argument("--since", type=_when_argument, help="start (default: 30 days ago)")
    parser.add_argument("--until", type=_when_argument, help="end (default: now)")
    parser.add_argument("--job", help="report this job only")
    parser.add_argument("--csv", action="store_true", help="print CSV, one row per job and team")
    _connection_arguments(parser)
    parser.set_defaults(handler=_usage)


def parse_when(text: str, now: float) -> float:
    """Epoch seconds of a date, a time (UTC unless it has an offset) or a span back from
    ``now`` (``7d``, ``12h``, ``30m``); ValueError when it is none of these."""
    span = _SPAN.match(text.strip())
    if span:
        return now - float(span.group(1)) * _UNIT_S[span.group(2)]
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"{text!r} is not a date (2026-11-01), a time (2026-11-01T12:00) or a span back "
            "from now (7d, 12h, 30m)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _when_argument(text: str) -> float:
    try:
        return parse_when(text, time.time())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _usage(args: argparse.Namespace) -> int:
    query = {
        name: value
        for name, value in (("since", args.since), ("until", args.until), ("job", args.job))
        if value is not None
    }
    path = ApiPaths.USAGE + ("?" + urllib.parse.urlencode(query) if query else "")
    render = usage_csv if args.csv else usage_text
    return show(args, path, lambda body: sys.stdout.write(render(body)))


def _when(seconds: object) -> str:
    if not isinstance(seconds, int | float):
        return "?"
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M UTC")


def _money(value: object, currency: str) -> str:
    return f"{value:,.2f} {currency}" if isinstance(value, int | float) else "-"


def _total(row: Mapping[str, Any], body: Mapping[str, Any]) -> str:
    """A total: ``-`` without a price table, ``≥ x`` when part of the use is unpriced."""
    if not body.get("priced"):
        return "-"
    money = _money(row.get("total"), str(body.get("currency", "")))
    return f">= {money}" if row.get("unpriced") else money


def _number(value: object, digits: int = 2) -> str:
    return f"{value:,.{digits}f}" if isinstance(value, int | float) else "-"


def usage_text(body: Mapping[str, Any]) -> str:
    """The report as a per-job table, a per-team table and what went unpriced."""
    currency = str(body.get("currency", ""))
    lines = [f"usage from {_when(body.get('since'))} to {_when(body.get('until'))}"]
    if not body.get("priced"):
        lines.append("no price table (prices: in the coordinator's config): use only, no cost")
    jobs = body.get("jobs") or []
    rows = [
        ("TEAM", "JOB", "GPU-H", "WAN-GB", "STORE-GB-MO", "TOKENS", "ROUNDS", "COST", "PER-1M-TOK")
    ]
    for job in jobs:
        rows.append(
            (
                str(job.get("team", "?")),
                str(job.get("job", "?")),
                _number(job.get("gpu_hours")),
                _number((job.get("upload_gb") or 0) + (job.get("download_gb") or 0), 3),
                _number(job.get("storage_gb_months"), 4),
                f"{job.get('tokens', 0):,}",
                str(job.get("rounds", 0)),
                _total(job, body),
                _money(job.get("per_million_tokens"), currency),
            )
        )
    lines.append(queue_text(rows).rstrip("\n") if jobs else "no job used anything in the period")
    teams = body.get("teams") or []
    if teams:
        team_rows = [("TEAM", "JOBS", "GPU-H", "WAN-GB", "STORE-GB-MO", "TOKENS", "COST")]
        for team in teams:
            team_rows.append(
                (
                    str(team.get("team", "?")),
                    str(team.get("jobs", 0)),
                    _number(team.get("gpu_hours")),
                    _number(team.get("wan_gb"), 3),
                    _number(team.get("storage_gb_months"), 4),
                    f"{team.get('tokens', 0):,}",
                    _total(team, body),
                )
            )
        lines += ["", queue_text(team_rows).rstrip("\n")]
    unpriced = [f"  {job['job']}: {what}" for job in jobs for what in job.get("unpriced") or ()]
    if unpriced and body.get("priced"):
        lines += ["", "not priced (counted above, left out of the cost, >=):", *unpriced]
    return "\n".join(lines) + "\n"


def usage_csv(body: Mapping[str, Any]) -> str:
    """The report as CSV (:data:`CSV_COLUMNS`)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    currency = body.get("currency", "")
    for job in body.get("jobs") or []:
        wan = (job.get("upload_gb") or 0) + (job.get("download_gb") or 0)
        writer.writerow(
            {
                **job,
                "scope": "job",
                "wan_gb": wan,
                "currency": currency,
                "unpriced": "; ".join(job.get("unpriced") or ()),
            }
        )
    for team in body.get("teams") or []:
        writer.writerow(
            {
                **team,
                "scope": "team",
                "job": "",
                "currency": currency,
                "unpriced": "; ".join(team.get("unpriced") or ()),
            }
        )
    return out.getvalue()
