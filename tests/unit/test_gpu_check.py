"""The GPU check's plan and how it reads each step's figures (the committed CPU results)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.gpu_check import (
    junit_figures,
    quantize_figures,
    round_gap_figures,
    steps,
    throughput_figures,
)

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_the_gpu_steps_fit_in_eight_minutes_and_size_for_the_gpus() -> None:
    plan = steps(cpu=False)
    assert [step.name for step in plan] == [
        "tests",
        "tput-350m",
        "tput-1b",
        "quantize",
        "round-gap",
    ]
    assert sum(step.timeout_s for step in plan) <= 8 * 60
    commands = {step.name: step.command(Path("out.json"), 8) for step in plan}
    assert commands["tput-350m"][-6:-3] == ["2", "--world-sizes", "8"]
    assert "--preset" in commands["tput-1b"]
    assert "1b" in commands["tput-1b"]
    assert "--precision=bf16" in commands["tput-1b"]
    assert "--parallelism=fsdp" in commands["tput-1b"]
    assert "--device=cuda" in commands["quantize"]
    assert "--modes=none,delayed" in commands["round-gap"]
    assert commands["tests"][2:4] == ["pytest", "tests/gpu"]


def test_on_the_cpu_every_step_is_a_smoke_run() -> None:
    for step in steps(cpu=True):
        command = step.command(Path("out.json"), 0)
        assert "cuda" not in " ".join(command)
        if step.name != "tests":
            assert "--smoke" in command, step.name
    assert [s.name for s in steps(cpu=True) if s.cuda_only] == ["tests"]


def test_throughput_figures_per_configuration() -> None:
    figures = throughput_figures(RESULTS / "training_throughput.json")
    assert figures["parameters"] == 1049984
    first = figures["results"][0]
    assert first["config"] == "ddp fp32 x1"
    assert first["ratio"] == pytest.approx(first["tokens_per_s"] / first["plain_tokens_per_s"])
    assert first["mfu"] is None  # no known peak on this CPU: absent, not zero


def test_quantize_figures_per_gb_of_fp32_delta() -> None:
    figures = quantize_figures(RESULTS / "handoff.json")
    gb = 4 * figures["params"] / 1e9
    assert figures["quantize_s_per_gb"] == pytest.approx(figures["quantize_s"] / gb)
    assert figures["delta_handoff_s"] < figures["params_handoff_s"]


def test_round_gap_figures_per_mode_and_size() -> None:
    figures = round_gap_figures(RESULTS / "utilization.json")
    none, delayed = (
        figures["modes"]["none"]["sizes"]["s"],
        figures["modes"]["delayed"]["sizes"]["s"],
    )
    assert 0 < none["compute_utilization"] < delayed["compute_utilization"] <= 1
    assert none["other_s"] > none["load_s"] > 0


def test_junit_figures_count_what_pytest_ran(tmp_path: Path) -> None:
    xml = tmp_path / "tests.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest" tests="3" failures="1" errors="0" '
        'skipped="0" time="12.5"></testsuite></testsuites>'
    )
    assert junit_figures(xml) == {
        "tests": 3,
        "failures": 1,
        "errors": 0,
        "skipped": 0,
        "seconds": 12.5,
    }
