"""A process that imports the daemons once and forks each daemon the demo starts from itself.

``python -m geofed_cli.demo.fork_server MODULE...`` imports the named modules (the
coordinator's and the agent's daemons, torch with them: about 3 CPU seconds a daemon
paid at each start), prints ``{"ready": pid}`` and then serves one request per line on
its stdin: ``{"id", "args", "env", "cwd", "log"}`` runs ``geofed ARGS`` in a child forked
from it, in a session of its own, with that environment and working directory, its
output appended to ``log`` (its standard error to ``"stderr"`` where the request names
one), and dying with the server (``PR_SET_PDEATHSIG``). Each
answer is one line on its stdout: ``{"id", "pid"}`` (or ``{"id", "error"}``) once the
child runs, ``{"exit": pid, "code": c}`` when a child ends (``c`` as
``os.waitstatus_to_exitcode`` gives it: ``-N`` for a signal). When its stdin closes it
stops its children (SIGTERM to each session, SIGKILL after a deadline) and exits.

The server stays single-threaded and runs nothing but imports, so a fork copies no
thread and no lock held by one. What a library reads from the environment when it loads
(``OMP_NUM_THREADS`` for torch's OpenMP pool) comes from the server's environment, not
the request's. :mod:`geofed_cli.demo.fork_client` starts and talks to it.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, NoReturn

__all__ = ["serve"]

#: What ``sys.argv[0]`` is in ``python -m geofed_cli``.
_CLI_MAIN: Final = str(Path(__file__).resolve().parents[1] / "__main__.py")
#: How long children get between SIGTERM and SIGKILL when the server stops.
STOP_DEADLINE_S: Final = 10.0


def _send(message: dict[str, Any]) -> None:
    # Straight to the descriptor: nothing may sit in a buffer that a child would inherit.
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(1, data) :]


def serve(preload: Sequence[str]) -> None:
    """Import ``preload``, then serve requests on stdin until it closes (module docstring)."""
    for name in preload:
        importlib.import_module(name)
    # The terminal's Ctrl-C is for whoever started the server; it stops with its stdin.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    _send({"ready": os.getpid()})
    pending = b""
    while True:
        readable, _, _ = select.select([0, wake_read], [], [])
        if wake_read in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_read, 4096)
        if 0 in readable:
            data = os.read(0, 65536)
            if not data:
                break
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.strip():
                    _answer(line, children, (wake_read, wake_write))
        _reap(children)
    _stop(children)


def _answer(line: bytes, children: set[int], wake: tuple[int, int]) -> None:
    try:
        request = json.loads(line)
    except ValueError as exc:
        _send({"id": None, "error": f"not JSON: {exc}"})
        return
    ident = request.get("id") if isinstance(request, dict) else None
    try:
        args = [str(arg) for arg in request["args"]]
        env = {str(k): str(v) for k, v in request["env"].items()}
        cwd = str(request["cwd"])
        paths = (str(request["log"]), str(request.get("stderr") or request["log"]))
    except (KeyError, TypeError, AttributeError) as exc:
        _send({"id": ident, "error": f"{type(exc).__name__}: {exc}"})
        return
    outputs: list[int] = []
    server = os.getpid()
    try:
        for path in paths:
            outputs.append(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
        pid = os.fork()
    except OSError as exc:  # a log it cannot open, out of processes or memory: refused
        for fd in outputs:
            os.close(fd)
        _send({"id": ident, "error": f"{type(exc).__name__}: {exc}"})
        return
    if pid == 0:
        _become(args, env, cwd, (outputs[0], outputs[1]), server, wake)
    for fd in outputs:
        os.close(fd)
    children.add(pid)
    _send({"id": ident, "pid": pid})


def _become(
    args: list[str],
    env: dict[str, str],
    cwd: str,
    outputs: tuple[int, int],
    server: int,
    wake: tuple[int, int],
) -> NoReturn:
    """In the child: the daemon's session, descriptors and environment, then ``geofed ARGS``."""
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        os.setsid()
        _die_with(server)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(outputs[0], 1)
        os.dup2(outputs[1], 2)
        for fd in (null, *outputs, *wake):
            os.close(fd)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        if env.get("PYTHONUNBUFFERED"):
            for stream in (sys.stdout, sys.stderr):
                if isinstance(stream, io.TextIOWrapper):
                    stream.reconfigure(write_through=True)
        sys.argv = [_CLI_MAIN, *args]
        _fresh_secrets()
    except BaseException:  # nothing may return into the server's loop
        os._exit(127)
    _run(args)


def _fresh_secrets() -> None:
    """What a new interpreter draws at random on its own, drawn again (``random`` is by
    Python at each fork): numpy's global generator, multiprocessing's authentication key."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    if "multiprocessing" in sys.modules:
        import multiprocessing

        multiprocessing.current_process().authkey = os.urandom(32)


def _die_with(server: int) -> None:
    from geofed.parent_death import die_with_parent

    request = die_with_parent(server)
    if request is not None:
        request()


def _run(args: list[str]) -> NoReturn:
    """``geofed ARGS`` as ``python -m geofed_cli ARGS`` would run it, and its exit."""
    from geofed.process_exit import exit_without_teardown
    from geofed_cli import main

    try:
        code = main(args)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:  # reported as the interpreter would, then exit 1
        traceback.print_exc()
        code = 1
    exit_without_teardown(code)


def _reap(children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _stop(children: set[int]) -> None:
    for sig, deadline in ((signal.SIGTERM, STOP_DEADLINE_S), (signal.SIGKILL, 5.0)):
        for pid in children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)
        end = time.monotonic() + deadline
        while children and time.monotonic() < end:
            with contextlib.suppress(OSError):
                _reap(children)
            time.sleep(0.05)
        if not children:
            return


if __name__ == "__main__":
    serve(sys.argv[1:])
