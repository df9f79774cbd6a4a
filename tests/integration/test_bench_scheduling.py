"""The scheduling benchmark runs end to end in its smoke mode and writes its report."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import scheduling


def test_scheduling_smoke_reports_every_policy(tmp_path: Path) -> None:
    out = tmp_path / "scheduling.json"
    assert scheduling.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    markdown = out.with_suffix(".md").read_text()
    assert markdown.startswith("# Multi-job scheduling")
    assert report["benchmark"] == "scheduling"
    assert report["machine"]["git"]["commit"]
    assert report["settings"]["smoke"] is True
    (federation,) = report["results"].values()
    assert set(federation) == set(scheduling.POLICIES)
    for policy, figures in federation.items():
        assert figures["finished"] == figures["jobs"] == 40, policy
        assert 0 < figures["utilisation"] <= 1, policy
        assert set(figures["wait_mean_min"]) == set(scheduling.PRIORITY_MIX)
    assert federation["fifo"]["preemptions"] == 0
    assert federation["priority"]["rounds_lost_to_preemption"] == 0
    lost = next(t for t in report["targets"] if "no rounds lost" in t["name"])
    assert lost["met"] is True
    for policy in scheduling.POLICIES:
        assert f"| 3 | {policy} |" in markdown
