"""The codec benchmark runs end to end on a tiny delta and reports every row it promises.

It asserts nothing about speed, only that the figures exist and are positive.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import codec_bench


def test_a_tiny_run_reports_every_scheme_policy_and_target(tmp_path: Path) -> None:
    out = tmp_path / "codec.json"
    argv = ["--sizes", "64K", "--repeats", "1", "--train-steps", "2", "--out", str(out)]
    assert codec_bench.main(argv) == 0
    results = json.loads(out.read_text())
    rows = {
        (row["data"], row["method"], row["compression"], row["threads"])
        for row in results["throughput"]
    }
    for data in ("normal", "heavy-tailed"):
        for scheme in ("fp32", "int8", "int4"):
            for policy in ("zstd", "none", "auto"):
                assert (data, scheme, policy, 1) in rows
        assert (data, "int8 naive torch quantizer (baseline)", "-", 1) in rows
    for row in results["throughput"]:
        assert row["round_trip_gbps_cpu"] > 0
    assert [check["name"].split("(")[1] for check in results["targets"]] == [
        "normal, default compression)",
        "heavy-tailed, default compression)",
    ]
    assert results["cuda"] == []
    assert "| heavy-tailed | int8 | auto |" in codec_bench.markdown(results)
