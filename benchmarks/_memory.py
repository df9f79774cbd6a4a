"""Peak resident memory of a block of code, read from /proc (tracemalloc misses torch).

Linux keeps a process's peak RSS in ``VmHWM`` of ``/proc/self/status`` and lets the
process reset it by writing ``5`` to ``/proc/self/clear_refs``, so the peak of one
block can be measured, not just the peak since start. Where the reset is not allowed
the figure is the peak since start and :attr:`PeakMemory.exact` says so.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import TracebackType

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def current_rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> int | None:
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def reset_peak_rss() -> bool:
    """Reset the peak-RSS mark to the current RSS; return whether that worked."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


class PeakMemory:
    """``with PeakMemory() as m: ...`` then ``m.extra_bytes``: the block's peak RSS
    above the RSS it started with (``None`` where /proc is unavailable)."""

    def __init__(self) -> None:
        self.exact = False
        self.baseline: int | None = None
        self.peak: int | None = None

    def __enter__(self) -> PeakMemory:
        self.exact = reset_peak_rss()
        self.baseline = current_rss_bytes()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.peak = peak_rss_bytes()

    @property
    def extra_bytes(self) -> int | None:
        if self.baseline is None or self.peak is None:
            return None
        return max(0, self.peak - self.baseline)
