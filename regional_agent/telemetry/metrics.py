"""The agent's metrics of its node's hardware (:mod:`regional_agent.telemetry.node`).

Series carry the ``host`` (its name; the per-rank series' ``node`` is the launcher's node
index instead) and, for a GPU, ``gpu`` (NVML's index, in PCI order): bounded by the
node's GPUs. A node without NVML has no GPU series (declared, with no samples), not even
``geofed_agent_gpus``; one whose GPUs could not be read has ``geofed_agent_gpus`` 0; a
figure a GPU does not report is absent rather than zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from prometheus_client import CollectorRegistry

from geofed.metric_spec import MetricSpec, gauge, set_or_remove
from regional_agent.telemetry.node import THROTTLE_REASONS, GpuSample, NodeSample

__all__ = ["HARDWARE", "HardwareMetrics"]


def _gpu(name: str, help_: str, *extra: str) -> MetricSpec:
    return MetricSpec(name, "gauge", help_, ("region", "host", "gpu", *extra))


GPU_UTILIZATION = _gpu(
    "geofed_agent_gpu_utilization_ratio", "Share of the last sample period a GPU was busy (NVML)."
)
GPU_MEMORY_USED = _gpu("geofed_agent_gpu_memory_used_bytes", "Memory in use on a GPU (NVML).")
GPU_MEMORY_TOTAL = _gpu("geofed_agent_gpu_memory_total_bytes", "A GPU's memory (NVML).")
GPU_TEMPERATURE = _gpu("geofed_agent_gpu_temperature_celsius", "A GPU's temperature (NVML).")
GPU_POWER = _gpu("geofed_agent_gpu_power_watts", "A GPU's power draw (NVML).")
GPU_ECC_ERRORS = _gpu(
    "geofed_agent_gpu_ecc_errors",
    "ECC errors a GPU counted over its life, corrected or uncorrected (NVML aggregate).",
    "kind",
)
GPU_THROTTLED = _gpu(
    "geofed_agent_gpu_throttled",
    "1 while a GPU's clocks are held down for the reason named (NVML clock event reasons).",
    "reason",
)
GPU_XID_ERRORS = _gpu(
    "geofed_agent_gpu_xid_errors",
    "Critical XID errors a GPU raised since the agent started, by XID code (NVML events).",
    "xid",
)
GPUS = MetricSpec(
    "geofed_agent_gpus",
    "gauge",
    "GPUs the agent's node read through NVML at the latest scrape (0: reading failed).",
    ("region", "host"),
)
NODE_MEMORY_TOTAL = MetricSpec(
    "geofed_agent_node_memory_total_bytes", "gauge", "The agent node's memory.", ("region", "host")
)
NODE_MEMORY_AVAILABLE = MetricSpec(
    "geofed_agent_node_memory_available_bytes",
    "gauge",
    "Memory available on the agent's node (MemAvailable).",
    ("region", "host"),
)
STATE_DISK_FREE = MetricSpec(
    "geofed_agent_state_disk_free_bytes",
    "gauge",
    "Free space on the disk of the agent's state directory.",
    ("region", "host"),
)
STATE_DISK_TOTAL = MetricSpec(
    "geofed_agent_state_disk_total_bytes",
    "gauge",
    "Size of the disk of the agent's state directory.",
    ("region", "host"),
)
#: The node's hardware, set by :meth:`HardwareMetrics.sampled`.
HARDWARE: Final[tuple[MetricSpec, ...]] = (
    GPU_UTILIZATION,
    GPU_MEMORY_USED,
    GPU_MEMORY_TOTAL,
    GPU_TEMPERATURE,
    GPU_POWER,
    GPU_ECC_ERRORS,
    GPU_THROTTLED,
    GPU_XID_ERRORS,
    GPUS,
    NODE_MEMORY_TOTAL,
    NODE_MEMORY_AVAILABLE,
    STATE_DISK_FREE,
    STATE_DISK_TOTAL,
)
_GPU_FIGURES: Final = (
    GPU_UTILIZATION,
    GPU_MEMORY_USED,
    GPU_MEMORY_TOTAL,
    GPU_TEMPERATURE,
    GPU_POWER,
)


class HardwareMetrics:
    """The hardware gauges of one agent (registered in its registry)."""

    def __init__(self, registry: CollectorRegistry, region: str) -> None:
        self.region = region
        self._hardware = {spec.name: gauge(spec, registry) for spec in HARDWARE}
        self._gpu_series: set[tuple[str, str]] = set()
        self._xid_series: set[tuple[str, str, str]] = set()

    def sampled(self, host: str, sample: NodeSample, gpus: Sequence[GpuSample] | None) -> None:
        """The node's hardware as sampled (``gpus`` None: no GPU reader, no GPU series);
        a figure a GPU does not report is removed rather than left at an older value."""
        hw, region = self._hardware, self.region
        for spec, value in (
            (NODE_MEMORY_TOTAL, sample.memory_total_bytes),
            (NODE_MEMORY_AVAILABLE, sample.memory_available_bytes),
            (STATE_DISK_FREE, sample.disk_free_bytes),
            (STATE_DISK_TOTAL, sample.disk_total_bytes),
            (GPUS, None if gpus is None else len(gpus)),
        ):
            set_or_remove(hw[spec.name], (region, host), value)
        seen = {(host, str(gpu.index)) for gpu in gpus or ()}
        for gone in self._gpu_series - seen:
            for spec in _GPU_FIGURES:
                hw[spec.name].remove(region, *gone)
            for kind in ("corrected", "uncorrected"):
                hw[GPU_ECC_ERRORS.name].remove(region, *gone, kind)
            for reason in THROTTLE_REASONS:
                hw[GPU_THROTTLED.name].remove(region, *gone, reason)
        self._gpu_series = seen
        for gpu in gpus or ():
            labels = (region, host, str(gpu.index))
            for spec, figure in zip(_GPU_FIGURES, _figures(gpu), strict=True):
                set_or_remove(hw[spec.name], labels, figure)
            for kind, count in (
                ("corrected", gpu.ecc_corrected),
                ("uncorrected", gpu.ecc_uncorrected),
            ):
                set_or_remove(hw[GPU_ECC_ERRORS.name], (*labels, kind), count)
            for reason in THROTTLE_REASONS:
                held = None if gpu.throttle_reasons is None else reason in gpu.throttle_reasons
                set_or_remove(hw[GPU_THROTTLED.name], (*labels, reason), held)
        # XIDs by code: a series per code raised; those of GPUs gone or unwatched removed.
        xids = {
            (host, str(gpu.index), str(xid)): count
            for gpu in gpus or ()
            for xid, count in (gpu.xid_errors or {}).items()
        }
        for stale in self._xid_series - set(xids):
            hw[GPU_XID_ERRORS.name].remove(region, *stale)
        for raised, count in xids.items():
            hw[GPU_XID_ERRORS.name].labels(region, *raised).set(count)
        self._xid_series = set(xids)


def _figures(gpu: GpuSample) -> tuple[float | None, ...]:
    return (
        gpu.utilization_ratio,
        gpu.memory_used_bytes,
        gpu.memory_total_bytes,
        gpu.temperature_celsius,
        gpu.power_watts,
    )
