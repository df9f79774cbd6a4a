"""The CLI piped into a reader that stops early (``geofed ... | head -1``) exits quietly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
POLICIES = REPO / "configs" / "policies"
COMMANDS = {
    # Written with one write to stdout's buffer from inside the handler.
    "mqtt-acl": ["mqtt", "acl", "--policies", str(POLICIES), "--federation", "demo"],
    # One short print: with buffered stdout it would fail only at interpreter exit.
    "policy-check": ["policy", "check", str(POLICIES)],
}


def run_cli(args: list[str], *, buffered: bool, stdout: int) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "geofed_cli", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        env=env,
        cwd=REPO,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_closed_stdout_ends_the_cli_quietly(command: str, buffered: bool) -> None:
    # The reader closes its end before the CLI writes anything: every write meets EPIPE.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = run_cli(COMMANDS[command], buffered=buffered, stdout=write_end)
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == 128 + signal.SIGPIPE


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_reader_that_reads_everything_gets_everything(command: str) -> None:
    result = run_cli(COMMANDS[command], buffered=True, stdout=subprocess.PIPE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n")
    if command == "policy-check":
        assert result.stdout == "ok: 3 policies\n"
    else:
        assert all(f"region.{r}" in result.stdout for r in ("eu-west", "us-east", "ap-south"))
