"""How much memory a process of the coordinator's holds, and a budget it keeps to.

The coordinator runs a job's task code (its ``build_model``, its ``evaluate``) only in
processes of their own when that code is not bounded in advance. :func:`resident_bytes`
reads a process's resident memory (Linux ``/proc``); :func:`keep_within` makes the
calling process end itself past a budget, saying so on its standard error (the
coordinator's log), so a task cannot swell the coordinator's host without limit.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Final

__all__ = ["OVER_BUDGET_EXIT", "POLL_S", "gib", "keep_within", "resident_bytes"]

#: How often resident memory is sampled.
POLL_S: Final = 0.05
#: The exit status of a process that ended itself past its budget (EX_SOFTWARE).
OVER_BUDGET_EXIT: Final = 70


def resident_bytes(pid: int | None = None) -> int:
    """The resident memory of process ``pid`` (this one by default); 0 where unknown."""
    try:
        with open(f"/proc/{pid or 'self'}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def gib(count: int) -> str:
    """``count`` bytes in GiB, as budgets are told."""
    return f"{count / 2**30:.2f} GiB"


def keep_within(max_bytes: int, what: str, key: str) -> None:
    """End this process (status :data:`OVER_BUDGET_EXIT`) once its resident memory passes
    ``max_bytes``, from a daemon thread sampling it every :data:`POLL_S`; ``what`` names
    the process and ``key`` the setting in a message to standard error."""

    def watch() -> None:
        while True:
            held = resident_bytes()
            if held > max_bytes:
                sys.stderr.write(
                    f"{what}: resident memory {gib(held)} passed {gib(max_bytes)} ({key}); "
                    "stopping\n"
                )
                sys.stderr.flush()
                os._exit(OVER_BUDGET_EXIT)
            time.sleep(POLL_S)

    threading.Thread(target=watch, name="geofed-memory-budget", daemon=True).start()
