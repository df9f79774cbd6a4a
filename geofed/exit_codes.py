"""The exit codes of both daemons, ``geofed coordinator`` and ``geofed agent``.

The systemd units (``deploy/systemd``) rely on them: ``Restart=on-failure`` restarts a
daemon that failed at run time, and ``RestartPreventExitStatus=2`` leaves one with a
configuration error stopped, since restarting cannot help until the files are fixed.

====  ===========  =====================================================================
code  name         meaning
====  ===========  =====================================================================
0     ``OK``       stopped cleanly: SIGTERM or SIGINT after finishing in-flight work, or
                   the agent's ``drain`` command finished
1     ``RUNTIME``  runtime failure: a port that cannot be bound, an unusable state
                   database, the worker group past its relaunch cap, a crash; restarting
                   may help
2     ``CONFIG``   configuration error: the config file, the files it names (trust
                   bundle, credential, policies; one nested too deep or too large
                   included) or a malformed ``$NOTIFY_SOCKET`` / ``$WATCHDOG_USEC``;
                   printed as ``file:line: key: message`` lines
====  ===========  =====================================================================
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ExitCode"]


class ExitCode(IntEnum):
    """A daemon's process exit status (see the module docstring)."""

    OK = 0
    RUNTIME = 1
    CONFIG = 2
