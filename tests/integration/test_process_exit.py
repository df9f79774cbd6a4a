"""``geofed.process_exit.exit_without_teardown`` in real processes.

Each case runs a small Python program as a process: its exit code, what its ``atexit``
handlers and its buffered output left on stdout, and whether the interpreter tore its
objects down (a finalizer that prints) tell what the exit did.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

PROGRAM = """
import atexit, sys, threading, time
from geofed.process_exit import exit_without_teardown

class Torn:
    def __del__(self):
        sys.stdout.write("torn down;")
        sys.stdout.flush()

kept = Torn()  # a module global: finalized only by the interpreter's teardown
atexit.register(lambda: sys.stdout.write("atexit ran;"))
sys.stdout.write("buffered;")  # no newline, no flush: still in the buffer at the exit
{extra}
exit_without_teardown(7)
"""


def run(extra: str = "") -> subprocess.CompletedProcess[str]:
    source = PROGRAM.format(extra=textwrap.dedent(extra))
    return subprocess.run(
        [sys.executable, "-c", source], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_the_exit_runs_atexit_handlers_flushes_and_skips_the_teardown() -> None:
    done = run()
    assert done.returncode == 7, done.stderr
    assert done.stdout == "buffered;atexit ran;", done.stdout
    assert done.stderr == ""


def test_a_working_thread_gets_a_normal_exit() -> None:
    # A non-daemon thread still at work: joined, and the interpreter tears everything
    # down as at any exit (the finalizer runs), with the same code.
    done = run(
        """
        def work():
            time.sleep(0.3)
            sys.stdout.write("thread done;")
        threading.Thread(target=work).start()
        """
    )
    assert done.returncode == 7, done.stderr
    assert done.stdout == "buffered;thread done;atexit ran;torn down;", done.stdout


def test_a_reader_gone_does_not_change_the_code() -> None:
    # The reader of stdout goes away while output is still buffered: the flush at the
    # exit meets a broken pipe, and the code stays the program's.
    program = "import sys\nsys.stdin.read()\n" + PROGRAM.format(extra="")
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    child = subprocess.Popen(
        [sys.executable, "-c", program],
        cwd=REPO,
        env=environment,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert child.stdin is not None
    assert child.stdout is not None
    assert child.stderr is not None
    child.stdout.close()
    child.stdin.close()  # the program goes on to its exit
    assert child.wait(timeout=60) == 7
    with child.stderr:
        assert b"Traceback" not in child.stderr.read()
