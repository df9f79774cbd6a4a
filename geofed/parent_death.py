"""A child process that dies with its parent, however the parent ends (Linux).

The kernel sends the child SIGTERM when the thread that started it exits
(``PR_SET_PDEATHSIG``), so a daemon killed with SIGKILL leaves no process of its own
running. Elsewhere there is no such request, and :func:`die_with_parent` gives None.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable
from typing import Final

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG: Final = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` asking the kernel for SIGTERM when ``parent`` dies (Linux only).

    ``prctl`` is looked up here, before the fork: the child only calls it.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        # The parent may have died between fork and prctl: then nobody would signal.
        if os.getppid() != parent:
            os._exit(1)

    return in_child
