"""The utilization benchmark runs end to end in its smoke mode (one overlap mode, to stay
short): a real federation through the WAN emulator, figures of the right shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import utilization

pytestmark = pytest.mark.slow


def test_utilization_smoke_reports_each_region_and_phase(tmp_path: Path) -> None:
    out = tmp_path / "utilization.json"
    assert utilization.main(["--smoke", "--modes", "none", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert out.with_suffix(".md").read_text().startswith("# ")
    assert report["benchmark"] == "utilization"
    assert report["machine"]["torch"]
    link = report["settings"]["link"]
    assert link["emulated"] == "20 Mbit/s, 80 ms RTT"
    assert "divided by 50" in link["scaling"]
    run = report["modes"]["none"]["runs"]["xs"]
    assert run["parameters"] > 0
    # The coordinator published both rounds, each in less time than the round took.
    coordinator = run["coordinator"]
    assert 0 < coordinator["aggregate_s"] < coordinator["round_s"]
    for region in utilization.REGIONS:
        figures = run["regions"][region]
        assert 0 < figures["compute_utilization"] <= 1
        assert figures["busy_s"] <= figures["span_s"]
        assert [r["round"] for r in figures["rounds"]] == [0, 1]
        for row in figures["rounds"]:
            assert row["train_s"] > 0
            for phase in ("sync", "load", "encode", "upload", "wait"):
                assert row[f"{phase}_s"] >= 0, (region, phase)
        # Every delta crossed the emulated link, and every update came back over it.
        assert figures["wan"]["bytes_up"] > 0
        assert figures["wan"]["bytes_down"] > 0
