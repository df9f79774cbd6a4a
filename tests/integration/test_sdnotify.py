"""The notify protocol against real unix datagram sockets, as systemd would hold them.

The watchdog's schedule itself runs on simulated time in ``tests/unit/test_sdnotify.py``;
here the real clock only has to deliver pings to a real socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from geofed.sdnotify import Notifier, run_watchdog


class NotifySink:
    """The service manager's end of a notify socket: a bound datagram socket."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)

    def receive(self, timeout_s: float = 2.0) -> str:
        self.sock.settimeout(timeout_s)
        return self.sock.recv(65536).decode()

    def pending(self) -> list[str]:
        """Every datagram already queued, without waiting."""
        self.sock.setblocking(False)
        found = []
        with contextlib.suppress(BlockingIOError):
            while True:
                found.append(self.sock.recv(65536).decode())
        return found

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    path = tmp_path / "notify.sock"
    assert len(str(path)) < 108, "tmp_path too long for a unix socket name"
    return path


@pytest.fixture
def sink(socket_path: Path) -> Iterator[NotifySink]:
    sink = NotifySink(str(socket_path))
    yield sink
    sink.close()


@pytest.fixture
def notifier(socket_path: Path, sink: NotifySink) -> Iterator[Notifier]:
    with Notifier.from_env({"NOTIFY_SOCKET": str(socket_path)}) as notifier:
        yield notifier


def test_ready_status_and_stopping_arrive(notifier: Notifier, sink: NotifySink) -> None:
    assert notifier.enabled
    assert notifier.ready("serving on :8443")
    assert sink.receive() == "READY=1\nSTATUS=serving on :8443"
    assert notifier.status("round 3 of job llm-7")
    assert sink.receive() == "STATUS=round 3 of job llm-7"
    assert notifier.watchdog()
    assert sink.receive() == "WATCHDOG=1"
    assert notifier.stopping()
    assert sink.receive() == "STOPPING=1"


def test_status_text_cannot_smuggle_another_assignment(
    notifier: Notifier, sink: NotifySink
) -> None:
    notifier.status("failed:\nREADY=1\n  retrying")
    assert sink.receive() == "STATUS=failed: READY=1 retrying"
    notifier.status("x" * 5000)
    received = sink.receive()
    assert received.startswith("STATUS=xxx")
    assert received.endswith("...")
    assert len(received) <= len("STATUS=") + 1024


def test_reloading_carries_the_monotonic_time(notifier: Notifier, sink: NotifySink) -> None:
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading("re-reading policies")
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    reloading, stamp, status = sink.receive().split("\n")
    assert reloading == "RELOADING=1"
    assert stamp.startswith("MONOTONIC_USEC=")
    assert before <= int(stamp.removeprefix("MONOTONIC_USEC=")) <= after
    assert status == "STATUS=re-reading policies"


def test_extend_timeout_and_malformed_assignments(notifier: Notifier, sink: NotifySink) -> None:
    notifier.extend_timeout(90)
    assert sink.receive() == "EXTEND_TIMEOUT_USEC=90000000"
    with pytest.raises(ValueError, match="positive"):
        notifier.extend_timeout(0)
    with pytest.raises(ValueError, match="single KEY=value"):
        notifier.notify("READY=1\nSTATUS=x")
    with pytest.raises(ValueError, match="single KEY=value"):
        notifier.notify("READY")
    assert sink.pending() == []


def test_abstract_socket() -> None:
    name = f"geofed-test-{secrets.token_hex(8)}"
    sink = NotifySink("\0" + name)
    try:
        with Notifier.from_env({"NOTIFY_SOCKET": "@" + name}) as notifier:
            assert notifier.ready()
            assert sink.receive() == "READY=1"
            assert notifier.stopping("bye")
            assert sink.receive() == "STOPPING=1\nSTATUS=bye"
    finally:
        sink.close()


def test_missing_socket_path_is_logged_once_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "gone.sock"
    caplog.set_level(logging.WARNING, logger="geofed.sdnotify")
    with Notifier.from_env({"NOTIFY_SOCKET": str(missing)}) as notifier:
        assert not notifier.ready()
        assert not notifier.watchdog()
        assert not notifier.watchdog()
    warnings = [r for r in caplog.records if r.name == "geofed.sdnotify"]
    assert len(warnings) == 1
    assert "ENOENT" in warnings[0].getMessage()
    assert str(missing) in warnings[0].getMessage()


def test_socket_nobody_listens_on_is_not_an_error(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(path))
    stale.close()  # the file stays, the listener is gone: ECONNREFUSED
    with Notifier.from_env({"NOTIFY_SOCKET": str(path)}) as notifier:
        assert not notifier.ready()


def test_full_queue_does_not_block_or_raise(
    notifier: Notifier, sink: NotifySink, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="geofed.sdnotify")
    started = time.monotonic()
    results = [notifier.watchdog() for _ in range(500)]
    assert time.monotonic() - started < 2.0
    assert results[0]
    assert not all(results), "the receiver never reads, so its queue must fill up"
    warnings = [r.getMessage() for r in caplog.records if r.name == "geofed.sdnotify"]
    assert len(warnings) == 1
    assert "EAGAIN" in warnings[0]
    assert len(sink.pending()) == results.count(True)
    assert notifier.watchdog(), "sending works again once the queue drained"


async def test_the_watchdog_pings_reach_the_socket_on_the_real_clock(
    notifier: Notifier, sink: NotifySink
) -> None:
    # Pings every 0.1 s; each receive waits up to 2 s, so a loaded machine only slows it.
    task = asyncio.create_task(run_watchdog(notifier, 0.2))
    try:
        for _ in range(3):
            assert await asyncio.to_thread(sink.receive) == "WATCHDOG=1"
        assert not task.done()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
