"""What the node's GPUs went through since the agent first ran on it, kept across restarts.

NVML counts uncorrectable ECC errors over a GPU's whole life, and reports XID events only
to a process that watches for them: a figure held in one process's memory starts again
with it, so a GPU that failed just before a restart (of the agent, or of the coordinator
that judges the risk) would look healthy after it. :class:`HardwareHistory` keeps, in
``hardware_history.json`` of the agent's state directory, each GPU's uncorrectable ECC
count when the agent first saw it (by UUID where NVML reports one, else by index) and the
critical XID events it saw, with their time (the last :data:`MAX_EVENTS`, none older than
:data:`KEEP_S`). Every sample then carries, per GPU, the ECC errors new since that first
sight and the XIDs of the last :data:`XID_WINDOW_S` (``ecc_uncorrected_new``,
``xid_recent``), whatever restarted in between.

A count below its baseline (another GPU at that index, or a count the driver reset) takes
a new baseline, logged. A history that cannot be read is set aside (``.corrupt``) and
started anew, logged: the telemetry goes on. The rules (:func:`ecc_new`,
:func:`record_xids`, :func:`recent_xids`) are pure; the class does the file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from geofed.fsutil import atomic_write_bytes
from regional_agent.telemetry.node import GpuSample

__all__ = [
    "HARDWARE_HISTORY_FILE",
    "KEEP_S",
    "MAX_EVENTS",
    "XID_WINDOW_S",
    "HardwareHistory",
    "XidEvent",
    "ecc_new",
    "gpu_key",
    "recent_xids",
    "record_xids",
]

log = logging.getLogger(__name__)

#: The history's file name in the agent's state directory.
HARDWARE_HISTORY_FILE: Final = "hardware_history.json"
#: The window of the ``xid_recent`` figure (and of the hardware risk's XID sign).
XID_WINDOW_S: Final = 24 * 3600.0
#: XID events older than this are forgotten.
KEEP_S: Final = 7 * 24 * 3600.0
#: At most this many XID events are kept (the latest).
MAX_EVENTS: Final = 256
_VERSION: Final = 1


@dataclass(frozen=True, slots=True)
class XidEvent:
    """A critical XID ``code`` of the GPU ``gpu`` (:func:`gpu_key`) seen at ``at`` (Unix time)."""

    at: float
    gpu: str
    code: int


def gpu_key(sample: GpuSample) -> str:
    """The GPU's name in the history: its UUID, else its index."""
    return sample.uuid if sample.uuid else f"index-{sample.index}"


def ecc_new(baseline: int | None, count: int) -> tuple[int, int, str | None]:
    """(errors new since the baseline, the baseline kept, why it changed or None).

    No baseline yet: this count is it. A count below it: another GPU, or a reset count,
    so the count is the new baseline."""
    if baseline is None:
        return 0, count, None
    if count < baseline:
        return 0, count, f"its count fell from {baseline} to {count}: counting from here"
    return count - baseline, baseline, None


def record_xids(
    events: Sequence[XidEvent], new: Iterable[XidEvent], now: float
) -> tuple[XidEvent, ...]:
    """``events`` with ``new`` appended, less those older than :data:`KEEP_S`, the last
    :data:`MAX_EVENTS` of them."""
    kept = [e for e in (*events, *new) if now - e.at <= KEEP_S]
    return tuple(kept[-MAX_EVENTS:])


def recent_xids(events: Iterable[XidEvent], gpu: str, now: float) -> int:
    """The XIDs of ``gpu`` in the last :data:`XID_WINDOW_S`."""
    return sum(1 for e in events if e.gpu == gpu and now - e.at <= XID_WINDOW_S)


class HardwareHistory:
    """The node's GPU history in ``path``: :meth:`observe` each sample (blocking file I/O,
    read on the first)."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock
        self._loaded = False  # read on the first sample, on the telemetry's thread
        self._baselines: dict[str, int] = {}
        self._events: tuple[XidEvent, ...] = ()
        # XIDs this process has already recorded, by (index, code): the watcher's counts
        # are since this process started, the history's since the first.
        self._recorded: Counter[tuple[int, int]] = Counter()

    def observe(self, gpus: Sequence[GpuSample]) -> list[GpuSample]:
        """``gpus`` with ``ecc_uncorrected_new`` and ``xid_recent`` set; the history saved
        when it changed."""
        if not self._loaded:
            self._baselines, self._events = self._load()
            self._loaded = True
        now = self._clock()
        changed = False
        new_events = []
        ecc: dict[str, int] = {}  # errors new since each GPU's baseline
        for gpu in gpus:
            key = gpu_key(gpu)
            if gpu.ecc_uncorrected is not None:
                ecc[key], kept, why = ecc_new(self._baselines.get(key), gpu.ecc_uncorrected)
                if why is not None:
                    log.warning("GPU %s: uncorrectable ECC errors: %s", key, why)
                changed |= self._baselines.get(key) != kept
                self._baselines[key] = kept
            for code, count in (gpu.xid_errors or {}).items():
                seen = count - self._recorded[(gpu.index, code)]
                if seen > 0:
                    self._recorded[(gpu.index, code)] = count
                    new_events += [XidEvent(now, key, code)] * seen
        if new_events:
            self._events = record_xids(self._events, new_events, now)
            changed = True
        if changed:
            self._save()
        return [self._figures(gpu, ecc.get(gpu_key(gpu)), now) for gpu in gpus]

    def _figures(self, gpu: GpuSample, ecc_new_count: int | None, now: float) -> GpuSample:
        watched = gpu.xid_errors is not None
        xids = recent_xids(self._events, gpu_key(gpu), now) if watched else None
        return replace(gpu, ecc_uncorrected_new=ecc_new_count, xid_recent=xids)

    def _load(self) -> tuple[dict[str, int], tuple[XidEvent, ...]]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}, ()
        except OSError as exc:
            log.warning("cannot read %s (%s): starting a new hardware history", self.path, exc)
            return {}, ()
        try:
            return _parse(json.loads(raw))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            aside = self.path.with_name(self.path.name + ".corrupt")
            with contextlib.suppress(OSError):  # could not move it: written over at the next save
                self.path.replace(aside)
            log.warning(
                "%s is not a hardware history (%s): kept as %s, starting a new one",
                self.path,
                exc,
                aside,
            )
            return {}, ()

    def _save(self) -> None:
        data = {
            "version": _VERSION,
            "ecc_baseline": self._baselines,
            "xid_events": [[e.at, e.gpu, e.code] for e in self._events],
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.path, json.dumps(data).encode())
        except OSError as exc:  # a full disk: the figures still stand, in memory
            log.warning("cannot save the hardware history %s: %s", self.path, exc)


def _parse(data: Mapping[str, Any]) -> tuple[dict[str, int], tuple[XidEvent, ...]]:
    if not isinstance(data, dict) or not isinstance(data.get("ecc_baseline"), dict):
        raise TypeError("not a JSON object with an ecc_baseline object")
    if not isinstance(data.get("xid_events"), list):
        raise TypeError("xid_events is not a list")
    if data["version"] != _VERSION:
        raise ValueError(f"version {data['version']!r}, expected {_VERSION}")
    baselines = {str(k): int(v) for k, v in data["ecc_baseline"].items()}
    if any(v < 0 for v in baselines.values()):
        raise ValueError("a negative ECC baseline")
    events = tuple(XidEvent(float(at), str(gpu), int(code)) for at, gpu, code in data["xid_events"])
    return baselines, events
