"""``geofed usage``: its times, its table and its CSV (pure parts)."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime

import pytest

from geofed_cli import build_parser
from geofed_cli.jobs import cost_line
from geofed_cli.usage import CSV_COLUMNS, parse_when, usage_csv, usage_text

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC).timestamp()

REPORT = {
    "since": datetime(2026, 11, 1, tzinfo=UTC).timestamp(),
    "until": NOW,
    "currency": "EUR",
    "priced": True,
    "jobs": [
        {
            "job": "llm", "team": "nlp", "gpu_hours": 16.0, "gpu_cost": 52.0,
            "upload_gb": 3.0, "upload_cost": 0.2, "download_gb": 1.0, "download_cost": 0.04,
            "storage_gb_months": 4.5, "storage_cost": 0.09, "tokens": 1_500_000, "rounds": 1,
            "total": 52.33, "per_million_tokens": 34.886666, "per_round": 52.33, "unpriced": [],
        },
        {
            "job": "vit", "team": "vision", "gpu_hours": 2.0, "gpu_cost": 0.0,
            "upload_gb": 1.0, "upload_cost": 0.0, "download_gb": 0.0, "download_cost": 0.0,
            "storage_gb_months": 0.0, "storage_cost": 0.0, "tokens": 0, "rounds": 0,
            "total": 0.0, "per_million_tokens": None, "per_round": None,
            "unpriced": ["GPU-hours in ap-south (A100)", "WAN from ap-south"],
        },
    ],
    "teams": [
        {"team": "nlp", "jobs": 1, "gpu_hours": 16.0, "wan_gb": 4.0, "storage_gb_months": 4.5,
         "tokens": 1_500_000, "total": 52.33, "unpriced": []},
        {"team": "vision", "jobs": 1, "gpu_hours": 2.0, "wan_gb": 1.0, "storage_gb_months": 0.0,
         "tokens": 0, "total": 0.0, "unpriced": ["vit: GPU-hours in ap-south (A100)"]},
    ],
}  # fmt: skip


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("7d", NOW - 7 * 86400),
        ("12h", NOW - 12 * 3600),
        ("1.5h", NOW - 5400),
        ("30m", NOW - 1800),
        ("2026-11-01", datetime(2026, 11, 1, tzinfo=UTC).timestamp()),
        ("2026-11-01T12:30", datetime(2026, 11, 1, 12, 30, tzinfo=UTC).timestamp()),
        ("2026-11-01T12:30+01:00", datetime(2026, 11, 1, 11, 30, tzinfo=UTC).timestamp()),
    ],
)
def test_when_is_a_date_a_time_or_a_span_back_from_now(text: str, expected: float) -> None:
    assert parse_when(text, NOW) == expected


@pytest.mark.parametrize("text", ["yesterday", "7w", "-3d", "2026-13-01", ""])
def test_a_when_that_is_none_of_these_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="is not a date"):
        parse_when(text, NOW)


def test_a_bad_since_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["usage", "--since", "last week"])
    assert exited.value.code == 2
    assert "'last week' is not a date" in capsys.readouterr().err


def test_the_table_shows_each_job_each_team_and_what_went_unpriced() -> None:
    text = usage_text(REPORT)
    lines = text.splitlines()
    assert lines[0] == "usage from 2026-11-01 00:00 UTC to 2026-12-06 12:00 UTC"
    assert lines[1].split() == [
        "TEAM", "JOB", "GPU-H", "WAN-GB", "STORE-GB-MO", "TOKENS", "ROUNDS", "COST", "PER-1M-TOK",
    ]  # fmt: skip
    assert lines[2].split() == [
        "nlp", "llm", "16.00", "4.000", "4.5000", "1,500,000", "1", "52.33", "EUR", "34.89", "EUR",
    ]  # fmt: skip
    # Part of vit's use is unpriced: its total is a floor.
    assert lines[3].split() == [
        "vision", "vit", "2.00", "1.000", "0.0000", "0", "0", ">=", "0.00", "EUR", "-",
    ]  # fmt: skip
    rows = [line.split() for line in lines]
    assert ["TEAM", "JOBS", "GPU-H", "WAN-GB", "STORE-GB-MO", "TOKENS", "COST"] in rows
    assert ["nlp", "1", "16.00", "4.000", "4.5000", "1,500,000", "52.33", "EUR"] in rows
    assert text.endswith(
        "not priced (counted above, left out of the cost, >=):\n"
        "  vit: GPU-hours in ap-south (A100)\n"
        "  vit: WAN from ap-south\n"
    )


def test_without_a_price_table_the_table_says_so_and_shows_no_cost() -> None:
    text = usage_text({**REPORT, "priced": False})
    assert "no price table (prices: in the coordinator's config): use only, no cost" in text
    rows = [line.split() for line in text.splitlines()]
    assert ["nlp", "llm", "16.00", "4.000", "4.5000", "1,500,000", "1", "-", "34.89", "EUR"] in rows
    assert "not priced" not in text
    text = usage_text({**REPORT, "priced": False, "jobs": [], "teams": []})
    assert "no job used anything in the period" in text


def test_the_csv_has_a_row_per_job_and_per_team() -> None:
    rows = list(csv.DictReader(io.StringIO(usage_csv(REPORT))))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert [(r["scope"], r["team"], r["job"]) for r in rows] == [
        ("job", "nlp", "llm"),
        ("job", "vision", "vit"),
        ("team", "nlp", ""),
        ("team", "vision", ""),
    ]
    assert float(rows[0]["wan_gb"]) == 4.0
    assert float(rows[0]["total"]) == 52.33
    assert rows[0]["currency"] == "EUR"
    assert rows[1]["unpriced"] == "GPU-hours in ap-south (A100); WAN from ap-south"
    assert rows[1]["per_million_tokens"] == ""


def test_a_jobs_status_line_shows_its_cost_and_projection() -> None:
    cost = {"currency": "EUR", "total": 12.25, "gpu": 10.0, "wan": 2.0, "storage": 0.25,
            "per_million_tokens": 6.125, "projected_total": 40.83, "unpriced": []}  # fmt: skip
    assert cost_line(cost) == (
        "cost so far 12.25 EUR (GPU 10.00, WAN 2.00, storage 0.25), "
        "projected 40.83 over all its rounds"
    )
    partial = {**cost, "projected_total": None, "unpriced": ["WAN from ap-south"]}
    assert cost_line(partial) == (
        "cost so far >= 12.25 EUR (GPU 10.00, WAN 2.00, storage 0.25); "
        "not priced: WAN from ap-south"
    )
