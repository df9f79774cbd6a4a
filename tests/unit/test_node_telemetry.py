"""The node's hardware figures (regional_agent/telemetry/node.py, hardware_metrics.py).

NVML is read through one narrow interface; here a fake ``pynvml`` module stands in for
it at that edge (``FakeNvml``, and a driver that fails, ``FakeBrokenGpus``, named as
such). The GPU paths run for real in tests/gpu.
"""

from __future__ import annotations

import asyncio
import queue
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from geofed.control import HardwareSummary
from regional_agent.telemetry.metrics import HardwareMetrics
from regional_agent.telemetry.node import (
    SLOWDOWN_REASONS,
    THROTTLE_REASONS,
    GpuSample,
    NodeSample,
    NodeTelemetry,
    NvmlReader,
    TelemetrySampler,
    open_nvml,
    parse_meminfo,
    read_node,
    summarize,
    throttle_names,
)

ROOT = Path(__file__).resolve().parents[2]

MEMINFO = "MemTotal:       65843212 kB\nMemFree:         1000 kB\nMemAvailable:   50331648 kB\n"


def test_meminfo_and_the_state_disk(tmp_path: Path) -> None:
    assert parse_meminfo(MEMINFO) == (65843212 * 1024, 50331648 * 1024)
    assert parse_meminfo("MemTotal: lots\n") == (None, None)
    info = tmp_path / "meminfo"
    info.write_text(MEMINFO)
    node = read_node(tmp_path, info)
    assert node.memory_available_bytes == 50331648 * 1024
    assert node.disk_free_bytes is not None
    assert node.disk_total_bytes is not None
    assert 0 < node.disk_free_bytes <= node.disk_total_bytes
    assert read_node(tmp_path, tmp_path / "absent").memory_total_bytes is None
    # The state directory not made yet (the metrics are served before the agent runs).
    early = read_node(tmp_path / "not-yet", info)
    assert early.disk_free_bytes is None
    assert early.memory_total_bytes == 65843212 * 1024


def test_throttle_reasons_by_name() -> None:
    assert throttle_names(0) == frozenset()
    assert throttle_names(0x4 | 0x40 | 0x10000) == {"sw_power_cap", "hw_thermal_slowdown"}


class NVMLError(Exception):
    pass


@dataclass
class FakeNvml:
    """A fake ``pynvml`` at the outer edge: three GPUs, the second without power or ECC
    (and bindings without the clock event reasons), the third lost."""

    NVMLError = NVMLError
    NVML_AGGREGATE_ECC = 1
    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1

    def nvmlDeviceGetCount(self) -> int:
        return 3

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index == 2:
            raise NVMLError("GPU is lost")
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return SimpleNamespace(used=(handle + 1) * 2**30, total=80 * 2**30)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return SimpleNamespace(gpu=97 if handle == 0 else 3)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        if handle == 1:
            raise NVMLError("Not Supported")
        return 612_500

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        if handle == 1:
            raise AttributeError("older bindings")
        return 0x40

    def nvmlDeviceGetTotalEccErrors(self, handle: int, kind: int, counter: int) -> int:
        if handle == 1:
            raise NVMLError("Not Supported")
        assert counter == self.NVML_AGGREGATE_ECC
        return 5 if kind == self.NVML_MEMORY_ERROR_TYPE_CORRECTED else 1

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return 83


def test_a_gpus_uuid_is_kept_once_read_though_a_failing_gpu_stops_giving_it() -> None:
    class FlakyUuids(FakeNvml):
        answers = 1

        def nvmlDeviceGetUUID(self, handle: int) -> str:
            if self.answers <= 0:
                raise NVMLError("GPU is lost")
            if handle == 1:
                self.answers -= 1
            return f"GPU-{handle}"

    reader = NvmlReader(FlakyUuids(), watch_xid=False)
    assert [g.uuid for g in reader.read()] == ["GPU-0", "GPU-1"]
    assert [g.uuid for g in reader.read()] == ["GPU-0", "GPU-1"]  # no longer answered
    assert [g.uuid for g in NvmlReader(FakeNvml(), watch_xid=False).read()] == [None, None]


def test_nvml_figures_and_what_a_gpu_does_not_support() -> None:
    first, second = NvmlReader(FakeNvml()).read()
    assert first == GpuSample(
        index=0,
        utilization_ratio=0.97,
        memory_used_bytes=2**30,
        memory_total_bytes=80 * 2**30,
        temperature_celsius=83.0,
        power_watts=612.5,
        ecc_corrected=5,
        ecc_uncorrected=1,
        throttle_reasons=frozenset({"hw_thermal_slowdown"}),
    )
    assert second.power_watts is None
    assert second.ecc_corrected is None
    assert second.throttle_reasons is None
    assert second.temperature_celsius == 83.0


class FakeDriverlessNvml:
    """A fake ``pynvml`` at the edge on a machine without an NVIDIA driver."""

    NVMLError = NVMLError

    def nvmlInit(self) -> None:
        raise NVMLError("NVML Shared Library Not Found")


def test_without_a_driver_nvml_is_absent_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeDriverlessNvml())
    reader, why = open_nvml()
    assert reader is None
    assert why == "NVML is not available: NVML Shared Library Not Found"
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert open_nvml() == (None, "nvidia-ml-py is not installed")


class FakeBrokenGpus:
    """A fake reader at the edge whose driver fails on every read."""

    def read(self) -> list[GpuSample]:
        raise RuntimeError("GPU is lost")


def test_the_telemetry_opens_nvml_once_and_survives_a_failing_read(tmp_path: Path) -> None:
    opened: list[int] = []

    def opener() -> tuple[Any, str]:
        opened.append(1)
        return NvmlReader(FakeNvml()), "NVML"

    telemetry = NodeTelemetry(tmp_path, opener=opener, node="n1")
    for _ in range(2):
        node, gpus = telemetry.sample()
        assert node.disk_total_bytes is not None
        assert gpus is not None
        assert [g.index for g in gpus] == [0, 1]  # the lost one left out
    assert opened == [1]
    assert NodeTelemetry(tmp_path, gpus=FakeBrokenGpus(), node="n1").sample()[1] == []
    absent = NodeTelemetry(tmp_path, opener=lambda: (None, "no driver"), node="n1")
    assert absent.sample()[1] is None


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"region": "eu-west", "host": "n1", **labels})


def test_hardware_gauges_follow_the_samples(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    metrics = HardwareMetrics(registry, "eu-west")
    node = NodeSample(64, 48, 100, 500)
    gpus = NvmlReader(FakeNvml()).read()
    metrics.sampled("n1", node, gpus)
    assert value(registry, "geofed_agent_node_memory_available_bytes") == 48
    assert value(registry, "geofed_agent_state_disk_free_bytes") == 100
    assert value(registry, "geofed_agent_gpu_utilization_ratio", gpu="0") == 0.97
    assert value(registry, "geofed_agent_gpu_power_watts", gpu="0") == 612.5
    assert value(registry, "geofed_agent_gpu_power_watts", gpu="1") is None  # unsupported
    assert value(registry, "geofed_agent_gpu_ecc_errors", gpu="0", kind="uncorrected") == 1
    assert value(registry, "geofed_agent_gpu_throttled", gpu="0", reason="hw_thermal_slowdown") == 1
    assert value(registry, "geofed_agent_gpu_throttled", gpu="0", reason="gpu_idle") == 0
    assert value(registry, "geofed_agent_gpu_throttled", gpu="1", reason="gpu_idle") is None
    assert value(registry, "geofed_agent_gpus") == 2
    # GPU 1 gone from the node; reading failing; then no GPU reader at all.
    metrics.sampled("n1", node, gpus[:1])
    assert value(registry, "geofed_agent_gpu_utilization_ratio", gpu="1") is None
    assert value(registry, "geofed_agent_gpu_memory_total_bytes", gpu="1") is None
    metrics.sampled("n1", node, [])
    assert value(registry, "geofed_agent_gpus") == 0
    assert value(registry, "geofed_agent_gpu_utilization_ratio", gpu="0") is None
    metrics.sampled("n1", NodeSample(None, None, None, None), None)
    assert value(registry, "geofed_agent_gpus") is None
    assert value(registry, "geofed_agent_node_memory_total_bytes") is None
    assert value(registry, "geofed_agent_state_disk_free_bytes") is None


@pytest.mark.parametrize("mask", [0, 0x1FF])
def test_every_named_reason_is_one_bit(mask: int) -> None:
    assert len(throttle_names(mask)) == bin(mask).count("1")


class FakeHungGpus:
    """A fake reader at the edge whose driver hangs until the test lets it go."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def read(self) -> list[GpuSample]:
        self.calls += 1
        self.release.wait(10)
        return []


async def test_a_hung_driver_holds_up_one_thread_and_scrapes_keep_their_values(
    tmp_path: Path,
) -> None:
    gpus = FakeHungGpus()
    sampler = TelemetrySampler(NodeTelemetry(tmp_path, gpus=gpus, node="n1"))
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(sampler.sample(), 0.2)  # a scrape gives up
        assert await sampler.sample() is None  # the next finds it still running
        assert gpus.calls == 1
        gpus.release.set()
        sample = None
        for _ in range(100):
            sample = await sampler.sample()
            if sample is not None:
                break
            await asyncio.sleep(0.02)
        assert sample is not None
        assert sample[1] == []
    finally:
        gpus.release.set()
        sampler.close()


def test_a_node_is_summarized_for_the_regions_status() -> None:
    node = NodeSample(64 * 2**30, 40 * 2**30, 500 * 2**30, 900 * 2**30)
    gpus = NvmlReader(FakeNvml()).read()  # GPU 0: 97% busy, hot and slowed; GPU 1 less
    summary = summarize((node, gpus), "gpu-node-1")
    assert summary.host == "gpu-node-1"
    assert summary.gpus == 2
    assert summary.max_temperature_c == 83.0
    assert summary.ecc_uncorrected == 1  # GPU 1 does not report ECC
    assert summary.slowed_gpus == 1  # hw_thermal_slowdown on GPU 0; GPU 1 reports none
    assert summary.gpu_utilization == pytest.approx(sum(g.utilization_ratio or 0 for g in gpus) / 2)
    assert (summary.memory_available_bytes, summary.state_disk_free_bytes) == (
        40 * 2**30,
        500 * 2**30,
    )
    assert summary.describe().startswith("gpu-node-1: 2 GPUs ")
    assert "hottest 83 °C, 1 slowed down, 1 uncorrectable ECC errors" in summary.describe()
    history = summary.model_copy(update={"ecc_uncorrected_new": 1, "xid_errors_recent": 2})
    assert "1 uncorrectable ECC errors (1 new)" in history.describe()
    assert "2 XID errors in the last day" in history.describe()
    # No NVML: no GPU figure at all, not zeros.
    cpu = summarize((node, None), "cpu-node")
    assert (cpu.gpus, cpu.gpu_utilization, cpu.slowed_gpus) == (None, None, None)
    assert cpu.describe() == "cpu-node: no GPU read, 40.0 GiB memory free, 500.0 GiB disk free"
    # A driver reporting nonsense leaves its figures out, never the status.
    broken = summarize((node, [GpuSample(0, utilization_ratio=7.0)]), "bad-node")
    assert broken == HardwareSummary(host="bad-node")


def test_the_status_slowdowns_are_the_throttle_alerts() -> None:
    """One list of the reasons that slow a GPU down: the alert selects the same."""
    rules = yaml.safe_load((ROOT / "deploy/prometheus/geofed-rules.yml").read_text())
    (expr,) = [
        r["expr"]
        for g in rules["groups"]
        for r in g["rules"]
        if r.get("alert") == "GeofedGpuThrottled"
    ]
    selected = re.search(r'reason=~"([^"]+)"', expr)
    assert selected is not None
    assert frozenset(selected[1].split("|")) == SLOWDOWN_REASONS
    assert set(THROTTLE_REASONS) >= SLOWDOWN_REASONS


async def test_a_recent_sample_is_kept_and_a_hung_driver_gives_the_last_one(
    tmp_path: Path,
) -> None:
    now = [0.0]
    gpus = FakeHungGpus()
    gpus.release.set()
    sampler = TelemetrySampler(NodeTelemetry(tmp_path, gpus=gpus, node="n1"), lambda: now[0])
    try:
        first = await sampler.recent(10.0, 1.0)
        assert first is not None
        assert gpus.calls == 1
        now[0] = 5.0
        assert await sampler.recent(10.0, 1.0) is first  # young enough: not read again
        assert gpus.calls == 1
        now[0] = 20.0
        gpus.release.clear()  # the driver hangs now
        assert await sampler.recent(10.0, 0.1) is first  # the last, within the time given
        wait_for(lambda: gpus.calls == 2)  # the new reading started (and hangs)
    finally:
        gpus.release.set()
        sampler.close()


async def test_a_recent_sample_before_any_is_none_when_the_driver_hangs(tmp_path: Path) -> None:
    gpus = FakeHungGpus()
    sampler = TelemetrySampler(NodeTelemetry(tmp_path, gpus=gpus, node="n1"))
    try:
        assert await sampler.recent(10.0, 0.1) is None
    finally:
        gpus.release.set()
        sampler.close()


class NVMLError_Timeout(NVMLError):  # noqa: N801 - pynvml's name
    pass


class FakeEventNvml(FakeNvml):
    """The fake ``pynvml`` with NVML's event API: GPU 1 cannot be registered; events
    are handed out as the test queues them, else each wait times out."""

    NVMLError_Timeout = NVMLError_Timeout
    nvmlEventTypeXidCriticalError = 8  # noqa: N815 - pynvml's name

    def __init__(self) -> None:
        self.events: queue.Queue[Any] = queue.Queue()
        self.freed = threading.Event()
        self.fail_waits = False

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, event_set: str) -> None:
        assert (types, event_set) == (8, "event-set")
        if handle == 1:
            raise NVMLError("Not Supported")

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        if self.fail_waits:
            raise NVMLError("Unknown Error")
        try:
            return self.events.get(timeout=0.02)
        except queue.Empty:
            raise NVMLError_Timeout("Timeout") from None

    def nvmlEventSetFree(self, event_set: str) -> None:
        self.freed.set()


def wait_for(condition: Any) -> None:
    for _ in range(250):
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError("never happened")


def test_xid_events_are_counted_per_gpu_and_code() -> None:
    nvml = FakeEventNvml()
    reader = NvmlReader(nvml)
    try:
        first, second = reader.read()
        assert (first.xid_errors, second.xid_errors) == ({}, None)  # GPU 1 is not watched
        for xid in (79, 48, 79):
            nvml.events.put(SimpleNamespace(device=0, eventData=xid))
        nvml.events.put(SimpleNamespace(device=7, eventData=13))  # not a GPU it watches
        wait_for(lambda: reader.read()[0].xid_errors == {79: 2, 48: 1})
        summary = summarize((NodeSample(None, None, None, None), reader.read()), "n1")
        assert summary.xid_errors == 3
        assert "3 XID errors" in summary.describe()
    finally:
        reader.close()
    assert nvml.freed.wait(2)  # the watcher ends and lets go of the event set


def test_a_failing_wait_stops_the_watcher_and_the_counts_stay() -> None:
    nvml = FakeEventNvml()
    reader = NvmlReader(nvml)
    try:
        reader.read()
        nvml.events.put(SimpleNamespace(device=0, eventData=94))
        wait_for(lambda: reader.read()[0].xid_errors == {94: 1})
        nvml.fail_waits = True
        assert nvml.freed.wait(2)
        assert reader.read()[0].xid_errors == {94: 1}
    finally:
        reader.close()


def test_bindings_without_events_watch_no_xid() -> None:
    first, _ = NvmlReader(FakeNvml()).read()
    assert first.xid_errors is None


def test_the_xid_gauges_follow_the_gpus(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    metrics = HardwareMetrics(registry, "eu-west")
    node = NodeSample(None, None, None, None)
    name = "geofed_agent_gpu_xid_errors"
    metrics.sampled("n1", node, [GpuSample(0, xid_errors={79: 2}), GpuSample(1, xid_errors={})])
    assert (
        registry.get_sample_value(
            name, {"region": "eu-west", "host": "n1", "gpu": "0", "xid": "79"}
        )
        == 2
    )
    metrics.sampled("n1", node, [GpuSample(1, xid_errors={})])  # GPU 0 gone
    assert (
        registry.get_sample_value(
            name, {"region": "eu-west", "host": "n1", "gpu": "0", "xid": "79"}
        )
        is None
    )
