"""``geofed demo`` stopped by a signal leaves no process of its federation running.

The demo runs as a real process, with its broker, coordinator, agents, elastic launchers
and worker ranks (each daemon in a session of its own). Once every level runs, it is
sent SIGTERM (it stops its federation in order, as Ctrl-C does, and says so) or SIGKILL
(its daemons get SIGTERM from the kernel, the parent-death signal, and stop their own
children); either way every process it started is gone shortly after.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from geofed_cli.demo.chaos import worker_pids

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# One worker a region, on the CPU wherever it runs: each level, not each rank, is the point.
DEMO = (
    *(sys.executable, "-m", "geofed_cli", "demo", "--rounds", "60", "--regions", "2"),
    *("--workers", "1"),
)
UP_S = 180.0
GONE_S = 60.0


def _stat(pid: int) -> tuple[int, str, str] | None:
    """(ppid, state, start time) of a live process; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0], fields[19]


def _descendants(root: int) -> dict[int, str]:
    """Every process below ``root``, with its start time (so a reused pid is not it)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(stat[0], []).append(int(entry.name))
            starts[int(entry.name)] = stat[2]
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in starts:
            found[pid] = starts[pid]
            todo.extend(children.get(pid, []))
    return found


def _running(pid: int, start: str) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[1] != "Z" and stat[2] == start


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _start_demo(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / "demo.log"
    with log.open("wb") as out:
        demo = subprocess.Popen(
            [*DEMO, "--workdir", str(tmp_path / "demo")],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )
    return demo, log


def _every_level_up(demo: subprocess.Popen[bytes], log: Path) -> dict[int, str]:
    """The demo's processes once its worker ranks run."""
    deadline = time.monotonic() + UP_S
    while time.monotonic() < deadline:
        assert demo.poll() is None, log.read_text(errors="replace")[-3000:]
        below = _descendants(demo.pid)
        if worker_pids(demo.pid):
            return below
        time.sleep(0.5)
    raise AssertionError(f"no worker rank within {UP_S} s:\n{log.read_text()[-3000:]}")


def _left_running(processes: dict[int, str]) -> list[str]:
    deadline = time.monotonic() + GONE_S
    while time.monotonic() < deadline:
        left = [pid for pid, start in processes.items() if _running(pid, start)]
        if not left:
            return []
        time.sleep(0.5)
    return [f"{pid}: {_cmdline(pid)[:200]}" for pid in left]


def _cleanup(processes: dict[int, str]) -> None:
    for pid, start in processes.items():
        if _running(pid, start):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_the_demo_leaves_no_process_running(tmp_path: Path, sig: signal.Signals) -> None:
    demo, log = _start_demo(tmp_path)
    processes: dict[int, str] = {}
    try:
        processes = _every_level_up(demo, log)
        assert any("coordinator" in _cmdline(pid) for pid in processes)
        assert sum("geofed_cli agent" in _cmdline(pid) for pid in processes) >= 2
        demo.send_signal(sig)
        code = demo.wait(timeout=GONE_S)
        assert _left_running(processes) == []
        if sig is signal.SIGTERM:
            assert code == 1, log.read_text()[-2000:]
            assert "interrupted; the demo's processes were stopped" in log.read_text()
        else:
            assert code == -signal.SIGKILL
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        _cleanup(processes)
