"""The fork server that the federation tests (and the demo's harnesses) start daemons from.

A child runs ``geofed ARGS`` with the request's environment, working directory and log;
a request the server cannot carry out is refused and the server goes on serving; a
daemon's signals and exit reach whoever waits for it; closing the server stops its
running daemons cleanly, and a server killed outright takes them with it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from pathlib import Path

import pytest

from geofed.control.broker import EmbeddedBroker
from geofed.ports import unused_port
from geofed_cli.demo.fork_client import (
    DAEMON_MODULES,
    ForkedProcess,
    ForkServer,
    ForkServerError,
)
from tests.support.coordinator import write_setup
from tests.support.waiting import alive, eventually

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def started(tmp_path: Path, preload: tuple[str, ...] = ("geofed_cli",)) -> ForkServer:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    server = ForkServer(tmp_path / "fork-server.log", env, preload)
    server.start()
    return server


async def test_a_child_runs_with_its_environment_directory_and_log_and_bad_requests_are_refused(
    tmp_path: Path,
) -> None:
    server = await asyncio.to_thread(started, tmp_path)
    try:
        env = {**os.environ, "GEOFED_URL": "http://example.org"}
        # The environment: the job client reads its coordinator's address from it; its
        # standard error goes where the request says, apart from its output.
        child = server.spawn(
            ["job", "status", "tiny"],
            env=env,
            cwd=tmp_path,
            log_file=tmp_path / "a.log",
            stderr_file=tmp_path / "a.err",
        )
        assert await child.wait() == 2
        assert child.returncode == 2
        refused = "plain http is only for the loopback demo, not example.org"
        assert refused in (tmp_path / "a.err").read_text()
        assert (tmp_path / "a.log").read_text() == ""
        # The working directory: a relative path names a file in it.
        configs = REPO / "configs"
        ok = server.spawn(
            ["policy", "check", "policies"], env=env, cwd=configs, log_file=tmp_path / "b.log"
        )
        assert await ok.wait() == 0, (tmp_path / "b.log").read_text()
        # A log it cannot open: refused, and the server serves the next request.
        with pytest.raises(ForkServerError, match="refused: FileNotFoundError"):
            server.spawn(["--help"], env=env, cwd=tmp_path, log_file=tmp_path / "no" / "c.log")
        again = server.spawn(["--help"], env=env, cwd=tmp_path, log_file=tmp_path / "c.log")
        assert await again.wait() == 0
        assert "Multi-region federated training coordinator" in (tmp_path / "c.log").read_text()
    finally:
        await asyncio.to_thread(server.close)


async def _coordinator(
    server: ForkServer, tmp_path: Path, broker_port: int, name: str
) -> tuple[ForkedProcess, Path]:
    root = tmp_path / name
    setup = write_setup(root, broker_port)
    port = unused_port()
    text = setup.config_path.read_text()
    setup.config_path.write_text(text.replace("port: 0}", f"port: {port}}}"))
    log = root / "coordinator.log"
    child = await asyncio.to_thread(
        server.spawn,
        ["coordinator", "--config", str(setup.config_path)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        log_file=log,
    )

    def serving() -> bool:
        assert child.returncode is None, log.read_text()[-3000:]
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0

    await eventually(serving, timeout_s=60.0, poll_s=0.1)
    return child, log


@pytest.mark.timeout(180)
async def test_daemons_get_their_signals_stop_with_the_server_and_die_with_it(
    tmp_path: Path,
) -> None:
    async with EmbeddedBroker(port=0) as broker:
        server = await asyncio.to_thread(started, tmp_path, DAEMON_MODULES)
        # Each daemon leads a session of its own; a signal to it is its exit code.
        first, _ = await _coordinator(server, tmp_path, broker.port, "first")
        assert os.getsid(first.pid) == first.pid
        first.kill()
        assert await first.wait() == -signal.SIGKILL
        # Closing the server stops a running daemon the way systemd would: SIGTERM, exit 0.
        second, log = await _coordinator(server, tmp_path, broker.port, "second")
        await asyncio.to_thread(server.close)
        assert await second.wait() == 0, log.read_text()[-3000:]
        assert not alive(second.pid)
        # A server killed outright takes its daemons with it (the kernel's SIGTERM).
        server = await asyncio.to_thread(started, tmp_path, DAEMON_MODULES)
        third, _ = await _coordinator(server, tmp_path, broker.port, "third")
        assert server._proc is not None
        server._proc.kill()
        assert await third.wait() == -signal.SIGTERM
        await eventually(lambda: not alive(third.pid), timeout_s=30.0)
        with pytest.raises(ForkServerError, match="gone"):
            server.spawn(["--help"], env={}, cwd=tmp_path, log_file=tmp_path / "d.log")
        await asyncio.to_thread(server.close)
