"""The scheduling benchmark's own logic: the workload, the policies, the simulation.

Its end-to-end smoke run (which records the git revision, a child process) is in
``tests/integration/test_bench_scheduling.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import scheduling


def _workload(seed: int = 0) -> scheduling.Workload:
    return scheduling.draw_workload(
        seed, 3, 30, load=0.9, arrival_h=8.0, mtbf_h=48.0, downtime_min=30.0
    )


def test_workload_is_seeded_and_shared_by_every_policy() -> None:
    assert _workload(0) == _workload(0)
    assert _workload(0) != _workload(1)
    jobs = _workload(0).jobs
    assert {j.priority for j in jobs} <= set(scheduling.PRIORITY_MIX)
    assert all(1 <= j.min_regions <= len(j.regions) and j.snapshot_every >= 1 for j in jobs)


def test_fifo_baseline_has_no_priorities_ageing_or_preemption() -> None:
    config = scheduling.policy_config("fifo", _workload())
    assert set(config.priorities.values()) == {0}
    assert config.ageing.boost == 0
    assert not config.fair_share
    assert not config.preemption.enabled
    assert scheduling.policy_config("priority", _workload()).preemption.enabled


def test_every_job_finishes_and_boundary_preemption_loses_nothing() -> None:
    workload = _workload()
    fifo = scheduling.simulate(workload, "fifo")
    ours = scheduling.simulate(workload, "priority")
    at_once = scheduling.simulate(workload, "priority_immediate")
    for figures in (fifo, ours, at_once):
        assert figures["finished"] == figures["jobs"] == 30
        assert 0 < figures["useful_utilisation"] <= figures["utilisation"] <= 1
    assert fifo["preemptions"] == 0
    assert ours["rounds_lost_to_preemption"] == 0
    assert ours["max_rounds_lost_per_preemption"] == 0


def test_p95_is_the_value_below_which_95_percent_fall() -> None:
    assert scheduling.p95([]) is None
    assert scheduling.p95([5.0]) == 5.0
    assert scheduling.p95([float(i) for i in range(1, 101)]) == 95.0


@pytest.mark.parametrize("argv", [["--regions", "3,0"], ["--jobs", "0"], ["--load", "0"]])
def test_bad_arguments_are_refused(tmp_path: Path, argv: list[str]) -> None:
    out = tmp_path / "scheduling.json"
    with pytest.raises(SystemExit) as exc:
        scheduling.main([*argv, "--out", str(out)])
    assert exc.value.code == 2
    assert not out.exists()
