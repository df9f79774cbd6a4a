"""The ``geofed`` command line: one sub-command group per module in this package.

Each module exposes ``register(subparsers)``, adding its parser with a ``handler``
default that takes the parsed arguments and returns the process exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import select
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from geofed.process_exit import exit_without_teardown

# Sub-command modules, imported lazily so `geofed policy check` does not pay for torch.
_COMMAND_MODULES: tuple[str, ...] = (
    "agent",
    "ca",
    "coordinator",
    "demo",
    "export",
    "jobs",
    "lineage",
    "mqtt",
    "policy",
    "queue",
    "usage",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="geofed",
        description="Multi-region federated training coordinator.",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging verbosity (default: INFO)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMAND_MODULES:
        module = importlib.import_module(f"geofed_cli.{name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``geofed`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    handler = args.handler
    try:
        code: int = handler(args)
        # Output still buffered meets a closed pipe here rather than at interpreter exit.
        sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # a socket's, not stdout's: an error like any other
        # The reader went away (`geofed ... | head -1`): stop quietly, as a tool killed by
        # SIGPIPE would. SIGPIPE itself stays ignored, as Python sets it, so that the
        # daemons see a closed socket as an error rather than die of it.
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())  # the flush at exit must not fail again
        finally:
            os.close(devnull)
        return 128 + signal.SIGPIPE
    return code


def run() -> NoReturn:
    """The ``geofed`` command: :func:`main`, then an exit that skips the interpreter's
    teardown of torch and the rest (``geofed.process_exit``: half a second of CPU)."""
    exit_without_teardown(main())


def _stdout_closed() -> bool:
    """Whether stdout is a file descriptor whose reader has gone (poll reports an error)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False  # not a real file (captured output)
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(event & select.POLLERR for _, event in poller.poll(0))
