"""One fork server per test process, shared by every test's daemons.

The federation harnesses start their coordinators and agents through
:class:`geofed_cli.demo.processes.ChildSet` with ``fork_server=await shared_fork_server()``:
each daemon is forked from a process that imported the daemons once, where a new
interpreter paid about 3 CPU seconds of imports per start (torch's among them). The
daemons run ``geofed coordinator`` and ``geofed agent`` as ``python -m geofed_cli`` would,
in sessions of their own; their worker groups' launchers and ranks are started as in
production. Tests of how a daemon behaves as a process (its signals, its exit, sd_notify,
the demo's shutdown) start it as a new interpreter. The server stops when the test
process exits.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import tempfile
import threading
from pathlib import Path

from geofed_cli.demo.fork_client import ForkServer

__all__ = ["shared_fork_server"]

REPO = Path(__file__).resolve().parents[2]
_lock = threading.Lock()
_server: ForkServer | None = None


def _started() -> ForkServer:
    global _server
    with _lock:
        if _server is None:
            log_dir = Path(tempfile.mkdtemp(prefix="geofed-fork-server-"))
            # As ChildSet's own children get it: each daemon single-threaded on 2 cores.
            env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
            server = ForkServer(log_dir / "fork-server.log", env)
            server.start()
            atexit.register(server.close)
            _server = server
        return _server


async def shared_fork_server() -> ForkServer:
    """This process's fork server, started on first use (about 3 CPU seconds, once)."""
    return await asyncio.to_thread(_started)
