"""What a region measures while training: the stats value, MFU and peak FLOPs, all-reduce time."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.errors import InvalidHandoffData
from regional_agent.handoff.flops import flops_utilisation, peak_flops
from regional_agent.handoff.messages import RoundSummary
from regional_agent.handoff.training_stats import RankTiming, TrainingStats
from regional_agent.handoff.utilization import union_seconds

STATS = TrainingStats(
    step_seconds=0.2,
    tokens_per_second=5000.0,
    data_wait_seconds=0.4,
    learning_rate=1e-3,
    grad_norm=0.8,
    flops_per_token=6e6,
    comm_seconds=1.25,
    ranks=(RankTiming(0, 0, 0.2, 0.4), RankTiming(1, 0, 0.15, 0.1)),
)
SUMMARY = RoundSummary(
    job="job-a",
    round=3,
    steps=50,
    tokens=400,
    mean_loss=0.25,
    cursor=200,
    base_params_hash="b" * 64,
    params_hash="p" * 64,
    world_size=2,
    train_seconds=1.5,
    stats=STATS,
)


# -- peak FLOPs and MFU -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "precision", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
        ("NVIDIA H100 80GB HBM3", "fp32", 67e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H100 NVL", "bf16", 835e12),
        ("NVIDIA H200", "bf16", 989e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA A100 80GB PCIe", "fp32", 19.5e12),
    ],
)
def test_peak_flops_of_known_gpus(name: str, precision: str, expected: float) -> None:
    assert peak_flops(name, precision) == expected  # type: ignore[arg-type]


def test_unknown_devices_and_the_cpu_have_no_peak_unless_the_operator_gives_one() -> None:
    assert peak_flops(None, "fp32") is None
    assert peak_flops("NVIDIA GeForce GTX 1080", "bf16") is None
    assert peak_flops(None, "fp32", override=2e11) == 2e11
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16", override=5e14) == 5e14


def test_flops_utilisation_is_achieved_over_peak_of_every_device() -> None:
    # 1e5 tokens/s of a 125M model (7.5e8 FLOPs per token) on two H100s in bf16.
    assert math.isclose(flops_utilisation(1e5, 7.5e8, 989e12, 2), 7.5e13 / (2 * 989e12))
    assert flops_utilisation(0.0, 7.5e8, 989e12, 1) == 0.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((1.0, 1.0, 1.0, 0), "devices"),
        ((-1.0, 1.0, 1.0, 1), "tokens_per_second"),
        ((1.0, math.nan, 1.0, 1), "flops_per_token"),
        ((1.0, 1.0, 0.0, 1), "peak_per_device"),
    ],
)
def test_flops_utilisation_refuses_nonsense(args: tuple[float, float, float, int], message: str):
    with pytest.raises(ValueError, match=message):
        flops_utilisation(*args)


# -- all-reduce time ------------------------------------------------------------------------


def test_overlapping_all_reduces_count_once() -> None:
    assert union_seconds([]) == 0.0
    assert union_seconds([(1.0, 2.0)]) == 1.0
    # Buckets in flight together, then a gap, then one more.
    assert math.isclose(union_seconds([(1.5, 3.0), (1.0, 2.0), (2.5, 2.75), (5.0, 5.5)]), 2.5)


# -- the stats value --------------------------------------------------------------------------


def test_stats_refuse_negative_or_non_finite_figures() -> None:
    with pytest.raises(ValueError, match="step_seconds must be a finite number >= 0"):
        replace(STATS, step_seconds=-1.0)
    with pytest.raises(ValueError, match="tokens_per_second"):
        replace(STATS, tokens_per_second=math.inf)
    with pytest.raises(ValueError, match="comm_seconds"):
        replace(STATS, comm_seconds=-0.5)
    with pytest.raises(ValueError, match="peak_memory_bytes"):
        replace(STATS, peak_memory_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="grad_norm must be a number"):
        replace(STATS, grad_norm="big")  # type: ignore[arg-type]
    # A diverging step's norm is reported as +inf, never NaN (which would not equal itself).
    assert math.isinf(replace(STATS, grad_norm=math.inf).grad_norm)
    with pytest.raises(ValueError, match="grad_norm must not be NaN"):
        replace(STATS, grad_norm=math.nan)
    diverged = replace(SUMMARY, stats=replace(STATS, grad_norm=math.inf))
    assert RoundSummary.from_json(diverged.to_json()) == diverged


def test_summary_carries_stats_through_the_done_marker_and_the_result(tmp_path: Path) -> None:
    assert RoundSummary.from_json(SUMMARY.to_json()) == SUMMARY
    handoff = HandoffDir(tmp_path)
    handoff.write_result(SUMMARY, {"w": torch.ones(2)})
    handoff.write_done(SUMMARY)
    completed = handoff.read_completed("job-a", 3)
    assert completed is not None
    assert completed.summary.stats == STATS


def test_a_summary_without_stats_still_reads() -> None:
    body = json.loads(SUMMARY.to_json())
    del body["stats"]
    assert RoundSummary.from_json(json.dumps(body).encode()) == replace(SUMMARY, stats=None)


@pytest.mark.parametrize(
    ("stats", "message"),
    [
        ([1, 2], "stats must be an object"),
        ({**asdict(STATS), "gpu_temp": 80}, r"unknown fields \['gpu_temp'\]"),
        ({k: v for k, v in asdict(STATS).items() if k != "grad_norm"}, "grad_norm"),
        ({**asdict(STATS), "data_wait_seconds": -2}, "data_wait_seconds"),
    ],
)
def test_bad_stats_in_a_done_marker_are_named(stats: object, message: str) -> None:
    body = {**json.loads(SUMMARY.to_json()), "stats": stats}
    with pytest.raises(InvalidHandoffData, match=message):
        RoundSummary.from_json(json.dumps(body).encode(), "done.json")


def test_a_summary_of_workers_that_report_no_rank_timings_reads_without_them() -> None:
    body = json.loads(SUMMARY.to_json())
    del body["stats"]["ranks"]
    read = RoundSummary.from_json(json.dumps(body).encode())
    assert read.stats == replace(STATS, ranks=())


@pytest.mark.parametrize(
    ("ranks", "message"),
    [
        ({"0": 1}, "ranks must be a list"),
        ([[0, 0, 0.1, 0.0]], "a rank's timing must be an object"),
        ([{"rank": 0, "node": 0, "busy_seconds": 0.1}], "a rank's timing has the fields"),
        (
            [{"rank": 0, "node": 0, "busy_seconds": -1, "data_wait_seconds": 0, "host": ""}],
            "busy_seconds",
        ),
        (
            [{"rank": 0, "node": -1, "busy_seconds": 1, "data_wait_seconds": 0, "host": ""}],
            "node must be",
        ),
        (
            [{"rank": 1, "node": 0, "busy_seconds": None, "data_wait_seconds": 0, "host": ""}],
            "in rank order",
        ),
        (
            [{"rank": 0, "node": 0, "busy_seconds": None, "data_wait_seconds": 0, "host": 7}],
            "host must be a string",
        ),
    ],
)
def test_bad_rank_timings_in_a_done_marker_are_named(ranks: object, message: str) -> None:
    body = json.loads(SUMMARY.to_json())
    body["stats"]["ranks"] = ranks
    with pytest.raises(InvalidHandoffData, match=message):
        RoundSummary.from_json(json.dumps(body).encode(), "done.json")
