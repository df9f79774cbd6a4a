"""The node's GPU history: ECC baselines and XID events kept across agent restarts.

The GPUs' figures come as samples (what NVML gave; NVML itself is faked in
``test_node_telemetry.py``); the history's file is real, and a restart is a new
:class:`HardwareHistory` on the same file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from coordinator.scheduling.hardware_risk import region_risk
from geofed.control import HardwareSummary
from regional_agent.telemetry.history import (
    KEEP_S,
    MAX_EVENTS,
    XID_WINDOW_S,
    HardwareHistory,
    XidEvent,
    ecc_new,
    recent_xids,
    record_xids,
)
from regional_agent.telemetry.node import GpuSample, NodeSample, NodeTelemetry, summarize

NOW = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def gpu(index: int, ecc: int | None, xids: dict[int, int] | None = None) -> GpuSample:
    return GpuSample(index, uuid=f"GPU-{index}", ecc_uncorrected=ecc, xid_errors=xids)


def test_ecc_errors_count_from_the_first_sight_and_a_lower_count_is_a_new_baseline() -> None:
    assert ecc_new(None, 7) == (0, 7, None)
    assert ecc_new(7, 9) == (2, 7, None)
    new, kept, why = ecc_new(7, 2)
    assert (new, kept) == (0, 2)
    assert why is not None
    assert "fell from 7 to 2" in why


def test_xid_events_are_bounded_in_number_and_age() -> None:
    old = XidEvent(NOW - KEEP_S - 1, "GPU-0", 79)
    day_old = XidEvent(NOW - XID_WINDOW_S - 1, "GPU-0", 48)
    fresh = [XidEvent(NOW, "GPU-0", 48), XidEvent(NOW, "GPU-1", 79)]
    kept = record_xids([old, day_old], fresh, NOW)
    assert kept == (day_old, *fresh)
    assert recent_xids(kept, "GPU-0", NOW) == 1  # the day-old one is kept, not recent
    many = record_xids([], [XidEvent(NOW, "GPU-0", 13)] * (MAX_EVENTS + 5), NOW)
    assert len(many) == MAX_EVENTS


def test_new_ecc_errors_and_recent_xids_survive_an_agent_restart(tmp_path: Path) -> None:
    path, clock = tmp_path / "state" / "hardware_history.json", Clock()
    first = HardwareHistory(path, clock)
    (seen,) = first.observe([gpu(0, ecc=3, xids={})])
    assert (seen.ecc_uncorrected_new, seen.xid_recent) == (0, 0)  # the baseline: 3
    (seen,) = first.observe([gpu(0, ecc=5, xids={79: 1})])
    assert (seen.ecc_uncorrected_new, seen.xid_recent) == (2, 1)
    (seen,) = first.observe([gpu(0, ecc=5, xids={79: 1})])  # the same XID is counted once
    assert seen.xid_recent == 1

    clock.now += 3600  # the agent restarts: its XID watcher counts from zero again
    restarted = HardwareHistory(path, clock)
    (seen,) = restarted.observe([gpu(0, ecc=5, xids={})])
    assert (seen.ecc_uncorrected_new, seen.xid_recent) == (2, 1)
    (seen,) = restarted.observe([gpu(0, ecc=5, xids={48: 2})])
    assert seen.xid_recent == 3
    clock.now += XID_WINDOW_S
    (seen,) = HardwareHistory(path, clock).observe([gpu(0, ecc=5, xids={})])
    assert (seen.ecc_uncorrected_new, seen.xid_recent) == (2, 2)  # the first XID aged out


def test_a_gpu_without_ecc_or_xid_watching_has_no_figures_not_zeros(tmp_path: Path) -> None:
    history = HardwareHistory(tmp_path / "hardware_history.json", Clock())
    (seen,) = history.observe([GpuSample(1)])  # no UUID, no ECC, XIDs not watched
    assert (seen.ecc_uncorrected_new, seen.xid_recent) == (None, None)
    assert not (tmp_path / "hardware_history.json").exists()  # nothing to keep


def test_gpus_without_a_uuid_are_kept_by_index(tmp_path: Path) -> None:
    path = tmp_path / "hardware_history.json"
    HardwareHistory(path, Clock()).observe([GpuSample(2, ecc_uncorrected=4)])
    assert json.loads(path.read_text())["ecc_baseline"] == {"index-2": 4}


def test_an_unreadable_history_is_kept_aside_and_started_anew(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "hardware_history.json"
    path.write_text('{"version": 1, "ecc_baseline": {"GPU-0": -1}, "xid_events": []}')
    with caplog.at_level(logging.WARNING):
        (seen,) = HardwareHistory(path, Clock()).observe([gpu(0, ecc=9)])
    assert seen.ecc_uncorrected_new == 0  # a new baseline, 9
    assert "is not a hardware history" in caplog.text
    assert json.loads(path.read_text())["ecc_baseline"] == {"GPU-0": 9}
    assert (tmp_path / "hardware_history.json.corrupt").read_text().startswith('{"version": 1')


def test_the_region_status_and_its_risk_carry_the_history(tmp_path: Path) -> None:
    clock = Clock()
    history = HardwareHistory(tmp_path / "hardware_history.json", clock)
    history.observe([gpu(0, ecc=10, xids={}), gpu(1, ecc=0, xids={})])

    class Gpus:  # a fake reader at the edge: GPU 0 gained 2 ECC errors and an XID
        def read(self) -> list[GpuSample]:
            return [gpu(0, ecc=12, xids={79: 1}), gpu(1, ecc=0, xids={})]

    telemetry = NodeTelemetry(tmp_path, gpus=Gpus(), node="n1", history=history.observe)
    node, gpus = telemetry.sample()
    summary = summarize((node, gpus), "n1")
    assert (summary.ecc_uncorrected, summary.ecc_uncorrected_new) == (12, 2)
    assert summary.xid_errors_recent == 1
    risk = region_risk(summary, ecc_seen_first=12, failures_at=(), now=clock.now)
    # The coordinator's own first sight (12, after a restart of its own) is not used.
    assert "2 new uncorrectable ECC error(s)" in risk.reason
    assert "1 critical XID error(s) in the last day" in risk.reason
    assert risk.score == pytest.approx(1 - (1 - 0.85) * (1 - 0.5))


def test_an_agent_without_a_history_is_judged_from_the_coordinators_first_sight() -> None:
    older = HardwareSummary(host="n1", gpus=1, ecc_uncorrected=12)
    assert "2 new uncorrectable" in region_risk(older, 10, (), NOW).reason
    assert region_risk(older, 12, (), NOW).score == 0.0
    assert region_risk(older, None, (), NOW).score == 0.0
    node = NodeSample(None, None, None, None)
    assert summarize((node, [GpuSample(0)]), "n1").ecc_uncorrected_new is None


@pytest.mark.parametrize(
    "content",
    [
        b'{"version": 1, "ecc_baseline": [], "xid_events": []}',
        b'{"version": 1, "ecc_baseline": {}, "xid_events": "none"}',
        b"[1, 2]",
        b"not json",
    ],
)
def test_any_damaged_history_is_started_anew_and_the_telemetry_goes_on(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "hardware_history.json"
    path.write_bytes(content)
    (seen,) = HardwareHistory(path, Clock()).observe([gpu(0, ecc=9, xids={})])
    assert (seen.ecc_uncorrected_new, seen.xid_recent) == (0, 0)
    assert (tmp_path / "hardware_history.json.corrupt").read_bytes() == content


def test_a_failing_history_leaves_its_figures_out_not_the_gpus(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Gpus:  # a fake reader at the edge
        def read(self) -> list[GpuSample]:
            return [gpu(0, ecc=1)]

    def broken(_: object) -> list[GpuSample]:
        raise RuntimeError("disk gone")

    telemetry = NodeTelemetry(tmp_path, gpus=Gpus(), node="n1", history=broken)
    _, gpus = telemetry.sample()
    assert gpus == [gpu(0, ecc=1)]
    assert "hardware history failed" in caplog.text
