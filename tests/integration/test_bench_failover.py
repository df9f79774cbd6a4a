"""The failover benchmark runs one trial end to end and writes its report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import failover

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_failover_smoke_times_one_takeover(tmp_path: Path) -> None:
    out = tmp_path / "failover.json"
    assert failover.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "failover"
    (cell,) = report["results"].values()
    # The standby cannot serve before the killed leader's lease ran out, nor accept the
    # region's delta before it serves, nor publish before accepting it.
    assert 0 < cell["takeover_s"] <= cell["first_accept_s"] <= cell["published_s"]
    assert cell["takeover_s"] < 2.0 + 10.0  # the ttl, and start-up on a loaded machine
    assert cell["baseline_publish_s"] > 0
    assert "| 2 |" in out.with_suffix(".md").read_text()
