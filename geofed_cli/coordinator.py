"""``geofed coordinator --config FILE``: run the federation's coordinator daemon.

Exit codes: 0 clean stop (SIGTERM/SIGINT), 1 runtime failure, 2 configuration error.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "coordinator",
        help="run the coordinator daemon",
        description="Run the coordinator: HTTPS API, rounds, aggregation, checkpoints. "
        "Exit codes: 0 clean stop, 1 runtime failure, 2 configuration error.",
    )
    parser.add_argument(
        "--config", required=True, metavar="FILE", help="coordinator configuration (YAML)"
    )
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    # Imported here: `geofed --help` should not pay for torch.
    from coordinator.daemon import main

    return main(args.config)
