"""The transfer benchmark runs end to end on a small delta and reports every configuration.

It checks that the benchmark still runs (a coordinator process, the WAN emulator, the
agent's uploader) and writes figures of the right shape; it asserts nothing about speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import transfer

pytestmark = pytest.mark.integration


def test_transfer_reports_each_link_and_window(tmp_path: Path) -> None:
    out = tmp_path / "transfer.json"
    argv = ["--mb", "0.3", "--windows", "1,4", "--rtt-ms", "20", "--repeats", "1"]
    assert transfer.main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert out.with_suffix(".md").read_text().startswith("# ")

    assert report["benchmark"] == "transfer"
    assert report["machine"]["git"]
    assert {(t["link"], t["window"]) for t in report["trials"]} == {
        (link, window) for link in ("loopback", "wan") for window in (1, 4)
    }
    assert all(t["mb_per_s"] > 0 for t in report["trials"])
    assert [row["ratio_to_first_window"] for row in report["summary"]][::2] == [1.0, 1.0]
    assert {d["link"] for d in report["downloads"]} == {"loopback", "wan"}
    assert report["delta_bytes"] > 0
    assert report["chunks"] >= 2
