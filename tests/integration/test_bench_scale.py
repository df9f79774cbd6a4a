"""The scale benchmark runs end to end in its quick mode at its two smallest sizes: a real
federation per size, every role sampled, finite per-parameter figures in the report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import scale

pytestmark = pytest.mark.slow


def test_scale_quick_reports_every_role(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    argv = ["--quick", "--sizes", "0.03m,0.1m", "--inner-steps", "1", "--plain-steps", "2"]
    assert scale.main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert out.with_suffix(".md").read_text().startswith("# ")
    assert report["benchmark"] == "scale"
    assert report["machine"]["torch"]
    assert list(report["configs"]) == ["fsdp-w2"]
    config = report["configs"]["fsdp-w2"]

    for name in (*scale.ROLES, "launcher", "region_writes", "coordinator_writes"):
        value = config["per_parameter"][name]
        assert value is not None, name
        assert math.isfinite(value), name
    assert [c["figure"] for c in config["checks"]] == list(scale.ROLE_NAMES)
    assert all(c["met"] in (True, False) for c in config["checks"])
    assert math.isfinite(config["gap_s_per_gb"])

    for size in ("0.03m", "0.1m"):
        run = config["runs"][size]
        assert "error" not in run, run
        roles = [(p["role"], p["region"], p["rank"]) for p in run["processes"]]
        assert roles.count(("coordinator", None, None)) == 1
        for region in scale.REGIONS:
            assert ("agent", region, None) in roles
            assert ("launcher", region, None) in roles
            assert ("rank", region, 0) in roles
            assert ("rank", region, 1) in roles
        figures = run["figures"]
        for name in ("rank0", "other_rank", "agent", "coordinator"):
            assert 50 * 2**20 < figures[name] < 4 * 2**30, name
        assert figures["region_writes"] > 0
        # The inner optimizer state (AdamW: 8 B a parameter), amortized over its interval.
        assert figures["region_checkpoint"] > 8 * run["parameters"] / 2
        # And the θ file its agent writes whole every few rounds (4 B a parameter).
        assert figures["region_theta_file"] == 4 * run["parameters"]
        assert figures["region_writes"] == pytest.approx(
            figures["region_writes_steady"]
            + figures["region_checkpoint"] / scale.CHECKPOINT_INTERVAL
            + figures["region_theta_file"] / scale.THETA_FILE_INTERVAL
        )
        # One working-state save (θ, momentum, residual: 12 B a parameter) and one
        # snapshot (up to 4 B, zstd may shave a little).
        assert figures["coordinator_saves"] > 12 * run["parameters"]
        assert figures["coordinator_writes"] == pytest.approx(
            figures["coordinator_writes_steady"] + figures["coordinator_saves"] / 10
        )
        assert figures["coordinator_writes"] > 0
        assert figures["gap_s"] > 0
        assert 0 < config["throughput_ratio"][size] < 10
        for region in scale.REGIONS:
            assert run["figures"]["regions"][region]["rounds_recorded"] == 3
