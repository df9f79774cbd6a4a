"""``geofed agent --config FILE``: run a region's agent daemon.

Exit codes: 0 stopped cleanly, 1 runtime failure, 2 configuration error (see
:mod:`regional_agent.daemon`).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "agent",
        help="run a region's agent daemon",
        description="Run the regional agent: follow the coordinator's rounds, train them "
        "with the local worker group, and upload the region's deltas. Stops cleanly on "
        "SIGTERM. Exit codes: 0 clean stop, 1 runtime failure, 2 configuration error.",
    )
    parser.add_argument(
        "--config", required=True, type=Path, metavar="FILE", help="agent configuration (YAML)"
    )
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    # Imported here: the daemon pulls in torch, which other sub-commands do not need.
    from regional_agent.daemon import main

    return main(args.config)
