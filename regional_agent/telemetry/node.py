"""The hardware of the agent's node: its GPUs through NVML, its memory and state disk.

What the operator of a large run watches besides the job: each GPU's utilization, memory,
temperature, power, ECC error counts and the reasons its clocks are held down; the node's
memory and the free space under the agent's state directory. GPUs are read through one
narrow interface (:class:`GpuReader`); :class:`NvmlReader` is NVML's (``nvidia-ml-py``),
opened on the first sample. Where NVML cannot be opened (no NVIDIA driver, as on a CPU
region) there are no GPU figures at all; a figure a device does not report (unsupported,
or an error reading it) is absent, never zero, and a GPU that cannot be read at all is
left out. :class:`TelemetrySampler` takes the samples on a thread of its own, one at a
time, so a hung driver holds up neither the event loop nor the other threads.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import shutil
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

from pydantic import ValidationError

from geofed.control import HardwareSummary
from regional_agent.telemetry.xid_events import XidWatcher

__all__ = [
    "SLOWDOWN_REASONS",
    "THROTTLE_REASONS",
    "GpuReader",
    "GpuSample",
    "NodeSample",
    "NodeTelemetry",
    "NvmlReader",
    "TelemetrySampler",
    "open_nvml",
    "parse_meminfo",
    "read_node",
    "summarize",
    "throttle_names",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: NVML's clock event (throttle) reason bits, by the name the metrics use.
THROTTLE_REASONS: Final[dict[str, int]] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}


def throttle_names(mask: int) -> frozenset[str]:
    """The names of the reasons set in NVML's reason ``mask`` (unknown bits left out)."""
    return frozenset(name for name, bit in THROTTLE_REASONS.items() if mask & bit)


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU's figures at one moment; None: not supported by the device."""

    index: int
    utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    ecc_corrected: int | None = None
    """Corrected ECC errors over the device's life (NVML's aggregate count)."""
    ecc_uncorrected: int | None = None
    throttle_reasons: frozenset[str] | None = None
    xid_errors: Mapping[int, int] | None = None
    """Critical XID events since the agent started, by code (None: not watched)."""
    uuid: str | None = None
    ecc_uncorrected_new: int | None = None
    """Uncorrectable ECC errors since the agent first saw this GPU, across restarts
    (:mod:`regional_agent.telemetry.history`; None: no history kept, or no ECC)."""
    xid_recent: int | None = None
    """Critical XID events of the last day, across restarts (None: not watched)."""


class GpuReader(Protocol):
    """Where GPU figures come from (NVML, or a fake at this edge in tests)."""

    def read(self) -> list[GpuSample]:
        """Every GPU of the node, by index."""
        ...


@dataclass(frozen=True, slots=True)
class NodeSample:
    """The node's memory (None where /proc/meminfo is not readable) and state disk
    (None where the state directory is not there yet)."""

    memory_total_bytes: int | None
    memory_available_bytes: int | None
    disk_free_bytes: int | None
    disk_total_bytes: int | None


def parse_meminfo(text: str) -> tuple[int | None, int | None]:
    """``MemTotal`` and ``MemAvailable`` of a /proc/meminfo text, in bytes."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if name in ("MemTotal", "MemAvailable") and fields and fields[0].isdigit():
            unit = 1024 if fields[1:] == ["kB"] else 1
            found[name] = int(fields[0]) * unit
    return found.get("MemTotal"), found.get("MemAvailable")


def read_node(state_dir: Path, meminfo: Path = Path("/proc/meminfo")) -> NodeSample:
    """The node's memory and the disk ``state_dir`` is on."""
    try:
        total, available = parse_meminfo(meminfo.read_text())
    except OSError:
        total, available = None, None
    try:
        usage = shutil.disk_usage(state_dir)
    except OSError:
        return NodeSample(total, available, None, None)
    return NodeSample(total, available, usage.free, usage.total)


class NvmlReader:
    """:class:`GpuReader` over an initialised ``pynvml`` module; from its first read it
    also watches the GPUs' XID events (:mod:`regional_agent.telemetry.xid_events`)."""

    def __init__(self, nvml: Any, *, watch_xid: bool = True) -> None:
        self._nvml = nvml
        self._watch_xid = watch_xid
        self._xid: XidWatcher | None = None
        # A GPU's UUID, once read: a failing GPU may stop answering, and its history
        # (kept by UUID) must still be found.
        self._uuids: dict[int, str] = {}

    def read(self) -> list[GpuSample]:
        count = self._field(self._nvml.nvmlDeviceGetCount)
        if count is None:
            raise RuntimeError("NVML could not count the GPUs")
        handles = {}
        for index in range(int(count)):
            handle = self._field(functools.partial(self._nvml.nvmlDeviceGetHandleByIndex, index))
            if handle is not None:  # a GPU lost: the others are still read
                handles[index] = handle
        if self._watch_xid:
            self._watch_xid = False  # once: a GPU that could not be registered stays out
            self._xid = XidWatcher.start(self._nvml, handles)
        xids = self._xid.counts() if self._xid is not None else {}
        return [
            replace(self._sample(index, handle), xid_errors=xids.get(index))
            for index, handle in handles.items()
        ]

    def close(self) -> None:
        """Stop watching XID events."""
        if self._xid is not None:
            self._xid.close()

    def _sample(self, index: int, handle: Any) -> GpuSample:
        nvml = self._nvml
        memory = self._field(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        utilization = self._field(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        power_mw = self._field(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        reasons = self._field(lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(handle))

        def ecc(kind: int) -> int | None:
            total = self._field(
                lambda: nvml.nvmlDeviceGetTotalEccErrors(handle, kind, nvml.NVML_AGGREGATE_ECC)
            )
            return None if total is None else int(total)

        temperature = self._field(
            lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
        )
        if index not in self._uuids:
            uuid = self._field(lambda: nvml.nvmlDeviceGetUUID(handle))
            if uuid is not None:
                self._uuids[index] = str(uuid)
        return GpuSample(
            index=index,
            uuid=self._uuids.get(index),
            utilization_ratio=None if utilization is None else float(utilization) / 100.0,
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            temperature_celsius=None if temperature is None else float(temperature),
            power_watts=None if power_mw is None else float(power_mw) / 1000.0,
            ecc_corrected=ecc(nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ecc_uncorrected=ecc(nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
            throttle_reasons=None if reasons is None else throttle_names(int(reasons)),
        )

    def _field(self, read: Callable[[], T]) -> T | None:
        """``read()``, or None where the device does not report it (an NVML error, or a
        function these bindings do not have)."""
        try:
            return read()
        except (self._nvml.NVMLError, AttributeError):
            return None


def open_nvml() -> tuple[NvmlReader | None, str]:
    """NVML's reader, or None and why not (``nvidia-ml-py`` missing, no driver)."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, f"NVML is not available: {exc}"
    return NvmlReader(pynvml), "NVML"


Sample = tuple[NodeSample, list[GpuSample] | None]


#: The reasons the hardware or heat holds a GPU's clocks down (a power cap set on purpose
#: and idle clocks are not among them); the ``GeofedGpuThrottled`` alert selects these.
SLOWDOWN_REASONS: Final = frozenset(
    {"hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"}
)


def summarize(sample: Sample, host: str) -> HardwareSummary:
    """The node in a region's status (:class:`HardwareSummary`); figures a check refuses
    (a driver reporting nonsense) are left out, never the status."""
    node, gpus = sample
    fields: dict[str, Any] = {
        "memory_available_bytes": node.memory_available_bytes,
        "state_disk_free_bytes": node.disk_free_bytes,
    }
    if gpus is not None:
        utilization = [g.utilization_ratio for g in gpus if g.utilization_ratio is not None]
        temperatures = [g.temperature_celsius for g in gpus if g.temperature_celsius is not None]
        ecc = [g.ecc_uncorrected for g in gpus if g.ecc_uncorrected is not None]
        reasons = [g.throttle_reasons for g in gpus if g.throttle_reasons is not None]
        xids = [sum(g.xid_errors.values()) for g in gpus if g.xid_errors is not None]
        ecc_new = [g.ecc_uncorrected_new for g in gpus if g.ecc_uncorrected_new is not None]
        xid_recent = [g.xid_recent for g in gpus if g.xid_recent is not None]
        fields.update(
            xid_errors=sum(xids) if xids else None,
            ecc_uncorrected_new=sum(ecc_new) if ecc_new else None,
            xid_errors_recent=sum(xid_recent) if xid_recent else None,
            gpus=len(gpus),
            gpu_utilization=sum(utilization) / len(utilization) if utilization else None,
            max_temperature_c=max(temperatures, default=None),
            ecc_uncorrected=sum(ecc) if ecc else None,
            slowed_gpus=sum(1 for r in reasons if r & SLOWDOWN_REASONS) if reasons else None,
        )
    host = host[:255] or "unknown"
    try:
        return HardwareSummary(host=host, **fields)
    except ValidationError as exc:
        log.warning("hardware figures left out of the status: %s", exc)
        return HardwareSummary(host=host)


class NodeTelemetry:
    """Samples the node (:meth:`sample`, blocking); NVML is opened on the first sample.

    ``history`` adds to each GPU's sample what happened to it before (the agent's
    :class:`~regional_agent.telemetry.history.HardwareHistory`)."""

    def __init__(
        self,
        state_dir: Path,
        *,
        gpus: GpuReader | None = None,
        opener: Callable[[], tuple[GpuReader | None, str]] = open_nvml,
        node: str | None = None,
        history: Callable[[Sequence[GpuSample]], list[GpuSample]] | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.node = node or socket.gethostname()
        self._history = history
        self._gpus = gpus
        self._opener = None if gpus is not None else opener
        self._failed: str | None = None

    def sample(self) -> Sample:
        """The node's figures, and its GPUs' (None: no GPU reader; empty: reading failed).

        Blocking."""
        if self._opener is not None:
            self._gpus, why = self._opener()
            self._opener = None
            log.info("GPU telemetry on %s: %s", self.node, why)
        gpus = None
        if self._gpus is not None:
            try:
                gpus = self._with_history(self._gpus.read())
                failed = None
            except Exception as exc:  # a driver gone wrong: no figures rather than no scrape
                gpus, failed = [], str(exc)
            if failed != self._failed:  # logged when it changes, not at every scrape
                self._failed = failed
                if failed is None:
                    log.info("reading the GPUs works again")
                else:
                    log.warning("reading the GPUs failed: %s", failed)
        return read_node(self.state_dir), gpus

    def _with_history(self, gpus: list[GpuSample]) -> list[GpuSample]:
        """``gpus`` with their history's figures; without them where it fails (logged)."""
        if self._history is None:
            return gpus
        try:
            return self._history(gpus)
        except Exception:  # the history is an addition: the figures go on without it
            log.exception("the node's hardware history failed; its figures are left out")
            return gpus

    def close(self) -> None:
        """Stop what the GPU reader runs on its own (its XID watcher), if anything."""
        close = getattr(self._gpus, "close", None)
        if close is not None:
            close()


class TelemetrySampler:
    """Samples a :class:`NodeTelemetry` on a thread of its own, one sample at a time."""

    def __init__(
        self, telemetry: NodeTelemetry, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.telemetry = telemetry
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="geofed-telemetry")
        self._running: asyncio.Future[Sample] | None = None
        self._clock = clock
        self._latest: tuple[float, Sample] | None = None
        self._closed = False

    async def sample(self) -> Sample | None:
        """A fresh sample; None while the previous one is still being taken (a hung
        driver: the gauges keep their values, and no thread piles up behind it)."""
        if self._closed or (self._running is not None and not self._running.done()):
            return None
        loop = asyncio.get_running_loop()
        self._running = loop.run_in_executor(self._executor, self.telemetry.sample)
        # Kept when it ends, even after the caller gave up waiting for it.
        self._running.add_done_callback(self._keep)
        # Shielded: a scrape that gives up leaves the sample to finish on its thread.
        return await asyncio.shield(self._running)

    def _keep(self, done: asyncio.Future[Sample]) -> None:
        if not done.cancelled() and done.exception() is None:
            self._latest = (self._clock(), done.result())

    async def recent(self, max_age_s: float, timeout_s: float) -> Sample | None:
        """The last sample if it is at most ``max_age_s`` old, else a fresh one taken
        within ``timeout_s``; else (a hung driver) the last one, or None before any."""
        if self._latest is not None and self._clock() - self._latest[0] <= max_age_s:
            return self._latest[1]
        try:
            async with asyncio.timeout(timeout_s):
                sample = await self.sample()
        except TimeoutError:
            sample = None
        if sample is not None:
            return sample
        return None if self._latest is None else self._latest[1]

    def close(self) -> None:
        """Stop taking samples (a sample under way finishes on its own thread)."""
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.telemetry.close()
