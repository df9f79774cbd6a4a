"""The utilization benchmark's own logic: arguments, modes, per-round figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import utilization
from regional_agent.rounds.timeline import Interval, RoundTimeline


@pytest.mark.parametrize(
    "argv",
    [["--sizes", "s,huge"], ["--modes", "sparse"], ["--rtt", "80"], ["--scale", "0"]],
)
def test_bad_arguments_are_refused(tmp_path: Path, argv: list[str]) -> None:
    out = tmp_path / "utilization.json"
    with pytest.raises(SystemExit) as exc:
        utilization.main([*argv, "--out", str(out)])
    assert exc.value.code == 2
    assert not out.exists()


def test_defaults_scale_the_reference_link() -> None:
    settings = utilization.settings_from([])
    assert settings.sizes == ("s", "m")
    assert settings.link.describe() == "2.5 Mbit/s, 80 ms RTT"
    assert utilization.settings_from(["--big"]).sizes == ("s", "m", "l", "xl")


def test_every_mode_the_job_spec_accepts_is_available() -> None:
    modes = utilization.overlap_modes(["none", "delayed-eager", "streaming"])
    assert all(mode["available"] for mode in modes.values())
    assert utilization.MODE_FIELDS["delayed-eager"]["overlap_start"] == "eager"


def test_a_mode_the_job_spec_refuses_is_reported_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # A mode whose fields the spec refuses (here: streaming with eager starts).
    monkeypatch.setitem(
        utilization.MODE_FIELDS,
        "streaming-eager",
        {"overlap": "streaming", "overlap_start": "eager"},
    )
    modes = utilization.overlap_modes(["streaming-eager"])
    assert not modes["streaming-eager"]["available"]
    assert "needs overlap delayed" in modes["streaming-eager"]["detail"]


def _round(number: int, start: float) -> RoundTimeline:
    phases = {
        "sync": Interval(start, start + 1, 1),
        "train": Interval(start + 1, start + 5, 4),
        "encode": Interval(start + 5, start + 6, 1),
        "upload": Interval(start + 6, start + 8, 2),
        "wait": Interval(start + 8, start + 10, 2),
    }
    return RoundTimeline("job", number, phases, Interval(start + 1.5, start + 4.5, 3))


def test_region_figures_split_the_train_phase_into_training_and_load() -> None:
    figures = utilization.region_figures(
        [_round(1, 10), _round(0, 0)], {"bytes_up": 1, "bytes_down": 2}
    )
    first = figures["rounds"][0]
    assert first["round"] == 0
    assert first["train_s"] == 3
    assert first["load_s"] == 1
    assert first["round_s"] == 10
    assert figures["compute_utilization"] == pytest.approx(6 / 13)
    assert figures["mean_per_round"]["wait_s"] == 2  # the last round's wait is left out
    assert "## overlap: delayed\n\nnot available: x." in utilization.render(
        {
            "machine": {"cpu_model": "x", "usable_cpus": 2, "python": "3", "torch": "2",
                        "torch_cpu_capability": "x", "torch_threads": 1},
            "settings": {"regions": ["a"], "workers_per_region": 2, "rounds": 2,
                         "inner_steps": 5, "smoke": False, "note": "",
                         "link": {"emulated": "1 Mbit/s", "scaling": "scaled"}},
            "modes": {"delayed": {"detail": "not available: x", "runs": {}}},
        }
    )  # fmt: skip


def test_the_coordinators_share_of_the_wait_is_read_from_its_metrics() -> None:
    metrics = "\n".join(
        [
            "# TYPE geofed_aggregation_duration_seconds histogram",
            'geofed_aggregation_duration_seconds_bucket{job="tiny",le="+Inf"} 4.0',
            'geofed_aggregation_duration_seconds_sum{job="tiny"} 2.0',
            'geofed_aggregation_duration_seconds_count{job="tiny"} 4.0',
            'geofed_aggregation_duration_seconds_sum{job="other"} 90.0',
            'geofed_aggregation_duration_seconds_count{job="other"} 1.0',
            "# TYPE geofed_round_duration_seconds histogram",
            'geofed_round_duration_seconds_sum{job="tiny"} 10.0',
            'geofed_round_duration_seconds_count{job="tiny"} 4.0',
            "",
        ]
    )
    assert utilization.coordinator_figures(metrics, "tiny") == {
        "aggregate_s": 0.5,
        "round_s": 2.5,
    }
    assert utilization.coordinator_figures(metrics, "absent") == {
        "aggregate_s": None,
        "round_s": None,
    }
