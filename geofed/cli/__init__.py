"""The ``geofed`` command line: one sub-command group per module in this package.

Each module exposes ``register(subparsers)``, adding its parser with a ``handler``
default that takes the parsed arguments and returns the process exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# Sub-command modules, imported lazily so `geofed policy check` does not pay for torch.
_COMMAND_MODULES: tuple[str, ...] = ("agent", "ca", "coordinator", "demo", "jobs", "mqtt", "policy")


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
        module = importlib.import_module(f"geofed.cli.{name}")
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
    code: int = handler(args)
    return code
