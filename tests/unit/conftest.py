"""The unit tier's rule, enforced: no sockets, no processes, no process groups.

A unit test that opens a socket, starts a process or joins a torch.distributed process
group fails with a message saying so; such a test belongs in ``tests/integration``.
``socket.socketpair`` is allowed: asyncio's event loop wakes itself through one, and a
pair of connected in-process sockets reaches nothing outside the test.
"""

from __future__ import annotations

import multiprocessing.util
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest


class TierViolation(BaseException):
    """A unit test reached for the outside world.

    A BaseException, so that code under test which handles ``OSError`` (or any
    ``Exception``) as a network or process failure cannot swallow it.
    """


class _Guard:
    """Refuses outside-world calls, and remembers them in case the code under test hid one."""

    def __init__(self) -> None:
        self.violations: list[str] = []

    def violation(self, what: str) -> TierViolation:
        message = f"a unit test {what}; move it to tests/integration"
        self.violations.append(message)
        return TierViolation(message)

    def refuse(self, what: str) -> Callable[..., Any]:
        def refuse(*args: object, **kwargs: object) -> Any:
            raise self.violation(what)

        return refuse


_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    # Kept for _unit_tier: a violation the test already failed with is not reported twice.
    report = yield
    if report.failed:
        item.stash[_FAILED] = True
    return report


@pytest.fixture(autouse=True)
def _unit_tier(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[None]:
    guard = _Guard()
    real_init = socket.socket.__init__

    def socket_init(
        self: socket.socket,
        family: int = -1,
        type: int = -1,  # socket.socket's own parameter names, passed by keyword too
        proto: int = -1,
        fileno: int | None = None,
    ) -> None:
        # socket.socketpair() wraps the two ends it made with fileno=; a new socket has none.
        if fileno is None:
            raise guard.violation("opened a socket")
        real_init(self, family, type, proto, fileno)

    monkeypatch.setattr(socket.socket, "__init__", socket_init)
    monkeypatch.setattr(subprocess.Popen, "__init__", guard.refuse("started a process"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, guard.refuse(f"started a process (os.{name})"))
    # multiprocessing's spawn and forkserver start methods exec through this, not Popen.
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", guard.refuse("started a process"))
    if "torch" in sys.modules:  # imported by the collected modules; not loaded for the rest
        import torch.distributed

        monkeypatch.setattr(
            torch.distributed,
            "init_process_group",
            guard.refuse("joined a torch.distributed group"),
        )
    yield
    if guard.violations and not request.node.stash.get(_FAILED, False):
        pytest.fail("; ".join(guard.violations), pytrace=False)
