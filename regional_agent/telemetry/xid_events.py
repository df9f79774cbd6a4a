"""The node's GPUs' XID errors, counted as NVML reports them (critical errors only).

XIDs are NVML events, not figures to read: :class:`XidWatcher` registers every GPU of
the node for ``nvmlEventTypeXidCriticalError`` (a GPU that cannot be registered is left
out) and waits for events on a daemon thread of its own, a second at a time so that
:meth:`XidWatcher.close` ends it, counting each GPU's XIDs by code since the agent
started (XID 79: fallen off the bus; 48, 63, 64, 94, 95: memory errors; 74: NVLink). A
wait that fails other than by timing out stops the watcher, logged once.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

__all__ = ["XidWatcher"]

log = logging.getLogger(__name__)

#: How long one wait for an event lasts (ms): :meth:`XidWatcher.close` takes at most that.
WAIT_MS = 1000


class XidWatcher:
    """Counts the critical XID events of the GPUs registered (see the module docstring)."""

    def __init__(self, nvml: Any, event_set: Any, indexes: dict[Any, int]) -> None:
        self._nvml = nvml
        self._set = event_set
        self._indexes = indexes
        self._counts: Counter[tuple[int, int]] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="geofed-xid", daemon=True)

    @classmethod
    def start(cls, nvml: Any, handles: dict[int, Any]) -> XidWatcher | None:
        """A running watcher of the GPUs ``handles`` (index -> NVML handle); None where
        none can be registered (the bindings or the devices do not support it)."""
        try:
            event_set = nvml.nvmlEventSetCreate()
        except (nvml.NVMLError, AttributeError) as exc:
            log.info("XID events not watched: %s", exc)
            return None
        indexes: dict[Any, int] = {}
        for index, handle in handles.items():
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, event_set)
            except (nvml.NVMLError, AttributeError) as exc:
                log.info("XID events of GPU %d not watched: %s", index, exc)
                continue
            indexes[handle] = index
        if not indexes:
            nvml.nvmlEventSetFree(event_set)
            return None
        watcher = cls(nvml, event_set, indexes)
        watcher._thread.start()
        return watcher

    def counts(self) -> dict[int, dict[int, int]]:
        """GPU index -> XID code -> events since the watcher started (every watched GPU,
        with no event: an empty mapping)."""
        with self._lock:
            found: dict[int, dict[int, int]] = {index: {} for index in self._indexes.values()}
            for (index, xid), count in self._counts.items():
                found[index][xid] = count
        return found

    def close(self) -> None:
        """Stop watching: the thread ends within :data:`WAIT_MS` (never waited for)."""
        self._stop.set()

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the thread to end; whether it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        nvml = self._nvml
        try:
            while not self._stop.is_set():
                try:
                    event = nvml.nvmlEventSetWait_v2(self._set, WAIT_MS)
                except nvml.NVMLError_Timeout:
                    continue
                index = self._indexes.get(event.device)
                if index is None:
                    continue
                xid = int(event.eventData)
                with self._lock:
                    self._counts[(index, xid)] += 1
                log.error("GPU %d raised XID %d", index, xid)
        except Exception as exc:  # a driver gone wrong: no more events, said once
            log.warning("XID events no longer watched: %s", exc)
        finally:
            try:
                nvml.nvmlEventSetFree(self._set)
            except Exception as exc:
                log.debug("cannot free the XID event set: %s", exc)
