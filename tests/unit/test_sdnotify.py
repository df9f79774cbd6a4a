"""The notify protocol against real unix datagram sockets, as systemd would hold them."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from geofed.sdnotify import (
    Notifier,
    NotifyEnvironmentError,
    run_watchdog,
    watchdog_interval,
    without_notify_env,
)


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


class Recorder:
    """Records when each datagram arrives, on a thread, so a blocked event loop shows."""

    def __init__(self, sink: NotifySink) -> None:
        self.sink = sink
        self.arrivals: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Recorder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        self.sink.sock.settimeout(0.02)
        while not self._stop.is_set():
            try:
                payload = self.sink.sock.recv(65536).decode()
            except TimeoutError:
                continue
            self.arrivals.append((time.monotonic(), payload))

    def pings(self) -> list[float]:
        return [at for at, payload in self.arrivals if payload == "WATCHDOG=1"]


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


@pytest.mark.parametrize("environ", [{}, {"NOTIFY_SOCKET": ""}])
def test_without_a_socket_every_call_is_a_no_op(
    environ: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    notifier = Notifier.from_env(environ)
    assert not notifier.enabled
    assert not notifier.ready()
    assert not notifier.status("x")
    assert not notifier.watchdog()
    assert not notifier.stopping()
    assert caplog.records == []


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


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("relative/notify.sock", "absolute socket path or @abstract-name"),
        ("/" + "x" * 120, "longer than the 107 bytes"),
        ("@" + "x" * 120, "longer than the 108 bytes"),
        ("vsock:2:1234", "absolute socket path"),
    ],
)
def test_malformed_notify_socket_is_refused(value: str, message: str) -> None:
    with pytest.raises(NotifyEnvironmentError, match=message):
        Notifier.from_env({"NOTIFY_SOCKET": value})


def test_watchdog_interval() -> None:
    pid = os.getpid()
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": ""}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "250000", "WATCHDOG_PID": str(pid)}) == 0.25
    # Inherited by a child: the watchdog belongs to the parent.
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(pid + 1)}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "7"}, pid=7) == 1.0


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"WATCHDOG_USEC": "30s"}, "WATCHDOG_USEC='30s' is not an integer"),
        ({"WATCHDOG_USEC": "0"}, "must be positive"),
        ({"WATCHDOG_USEC": "-5"}, "must be positive"),
        ({"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "me"}, "WATCHDOG_PID='me'"),
    ],
)
def test_malformed_watchdog_environment_is_refused(environ: dict[str, str], message: str) -> None:
    with pytest.raises(NotifyEnvironmentError, match=message):
        watchdog_interval(environ)


def test_child_environment_drops_the_notify_variables() -> None:
    environ = {
        "NOTIFY_SOCKET": "/run/systemd/notify",
        "WATCHDOG_USEC": "30000000",
        "WATCHDOG_PID": "12",
        "PATH": "/usr/bin",
    }
    assert without_notify_env(environ) == {"PATH": "/usr/bin"}
    assert "NOTIFY_SOCKET" in environ


INTERVAL_S = 0.2  # pings every 0.1 s


async def watch_for(
    notifier: Notifier, seconds: float, alive: Callable[[], bool] = lambda: True
) -> asyncio.Task[None]:
    task = asyncio.create_task(run_watchdog(notifier, INTERVAL_S, alive=alive))
    await asyncio.sleep(seconds)
    return task


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_watchdog_pings_every_half_interval(notifier: Notifier, sink: NotifySink) -> None:
    with Recorder(sink) as recorder:
        task = await watch_for(notifier, 1.05)
        await stop(task)
        await asyncio.sleep(0.05)
    pings = recorder.pings()
    # 1.05 s at one ping per 0.1 s, the first at once: 11; the machine is shared and noisy.
    assert 8 <= len(pings) <= 12, pings
    gaps = sorted(b - a for a, b in itertools.pairwise(pings))
    assert 0.07 <= gaps[len(gaps) // 2] <= 0.14, gaps
    assert all(payload == "WATCHDOG=1" for _, payload in recorder.arrivals)


async def test_a_blocked_loop_stops_the_pings(notifier: Notifier, sink: NotifySink) -> None:
    with Recorder(sink) as recorder:
        task = await watch_for(notifier, 0.35)
        blocked_from = time.monotonic()
        time.sleep(0.6)  # a stuck call on the event loop  # noqa: ASYNC251
        blocked_until = time.monotonic()
        await asyncio.sleep(0.35)
        await stop(task)
        await asyncio.sleep(0.05)
    pings = recorder.pings()
    before = [t for t in pings if t < blocked_from]
    during = [t for t in pings if blocked_from + 0.02 < t < blocked_until - 0.02]
    after = [t for t in pings if t >= blocked_until]
    assert len(before) >= 2
    assert during == []
    assert len(after) >= 2, "pings resume once the loop turns again"
    assert after[0] - before[-1] >= 0.55
    # After the stall the schedule restarts from now: no burst of catch-up pings.
    assert len([t for t in after if t < blocked_until + 0.05]) <= 1


async def test_no_pings_while_the_daemon_says_it_is_not_alive(
    notifier: Notifier, sink: NotifySink, caplog: pytest.LogCaptureFixture
) -> None:
    healthy = True

    def alive() -> bool:
        return healthy

    with Recorder(sink) as recorder:
        task = await watch_for(notifier, 0.3, alive)
        healthy = False
        sick_from = time.monotonic()
        await asyncio.sleep(0.5)
        healthy = True
        sick_until = time.monotonic()
        await asyncio.sleep(0.3)
        await stop(task)
        await asyncio.sleep(0.05)
    pings = recorder.pings()
    assert [t for t in pings if sick_from + 0.02 < t < sick_until - 0.02] == []
    assert len([t for t in pings if t >= sick_until]) >= 2
    messages = [r.getMessage() for r in caplog.records if r.name == "geofed.sdnotify"]
    assert messages == [
        "daemon reports itself not alive; withholding watchdog pings",
        "daemon alive again; watchdog pings resumed",
    ]


async def test_a_health_check_that_raises_counts_as_not_alive(
    notifier: Notifier, sink: NotifySink
) -> None:
    def alive() -> bool:
        raise RuntimeError("engine state unreadable")

    with Recorder(sink) as recorder:
        task = await watch_for(notifier, 0.35, alive)
        assert not task.done(), "the watchdog task survives a failing health check"
        await stop(task)
    assert recorder.pings() == []


async def test_watchdog_refuses_a_non_positive_interval(notifier: Notifier) -> None:
    with pytest.raises(ValueError, match="positive"):
        await run_watchdog(notifier, 0)
