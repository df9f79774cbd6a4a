"""``geofed demo``: run a whole federation on this machine and train the example task.

Exit codes: 0 the job completed and ``summary.json`` was written, 1 the demo failed (the
message says where; the daemons' logs are in ``WORKDIR/logs``), 2 usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geofed.control.messages import OVERLAP_MODES

if TYPE_CHECKING:
    from geofed.wanspec import WanLink

EXIT_OK = 0
EXIT_FAILED = 1


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``geofed demo`` to the ``geofed`` parser."""
    parser = subparsers.add_parser(
        "demo",
        help="run a coordinator and regional agents on loopback and train the example task",
        description=(
            "Start an embedded MQTT broker, an ephemeral federation PKI, a coordinator and "
            "N regional agents on this machine (each with its own local workers: 2 gloo "
            "ranks on a CPU box, one NCCL rank per GPU of its share on a GPU box; the GPUs "
            "are split between regions, or shared when fewer); train the example byte-level "
            "language model; write WORKDIR/summary.json."
        ),
    )
    parser.add_argument("--rounds", type=_positive, default=10, help="outer rounds (default 10)")
    parser.add_argument("--regions", type=_positive, default=3, help="regions, 1 to 3 (default 3)")
    parser.add_argument(
        "--inner-steps", type=_positive, default=30, help="inner steps H per round (default 30)"
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="new or empty directory (default: a temp dir)"
    )
    parser.add_argument(
        "--configs", type=Path, default=None, help="example configs dir (default: ./configs)"
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="give up after this many seconds"
    )
    parser.add_argument(
        "--wan",
        type=_wan,
        default=None,
        metavar="BANDWIDTH,RTT",
        help="route each region's HTTPS traffic to the coordinator through an emulated WAN "
        "link, e.g. 5mbit,100ms (bandwidth each way in bit/kbit/mbit/gbit per second, "
        "round-trip time in us/ms/s); default: plain loopback",
    )
    parser.add_argument(
        "--overlap",
        choices=OVERLAP_MODES,
        default=None,
        help="the job's overlap mode (default: the job spec's own default); streaming "
        "splits the model into the job spec's default fragments",
    )
    parser.add_argument(
        "--task-options",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="overrides of the example task's options, e.g. '{\"d_model\": 64}'",
    )
    parser.add_argument(
        "--workers",
        type=_positive,
        default=None,
        help="worker ranks per region on a machine without a GPU (default: 2 gloo ranks); "
        "refused where a GPU is visible: each region then runs one rank per GPU of its share",
    )
    parser.add_argument(
        "--chaos",
        action="store_true",
        help="while the job runs, kill -9 an agent, a worker and the coordinator, restart the "
        "broker and cut a region off for a while; report what was lost (must be nothing "
        "acknowledged) and whether every region's parameters agree (exit 1 otherwise)",
    )
    parser.set_defaults(handler=_run)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _wan(text: str) -> WanLink:
    from geofed.wanspec import WanSpecError, parse_link

    try:
        return parse_link(text)
    except WanSpecError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _run(args: argparse.Namespace) -> int:
    from geofed_cli.demo.configs import DemoConfigError
    from geofed_cli.demo.processes import ChildFailed
    from geofed_cli.demo.runner import DemoFailed, DemoOptions, run_demo

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="geofed-demo-"))
    options = DemoOptions(
        workdir=workdir,
        rounds=args.rounds,
        regions=args.regions,
        inner_steps=args.inner_steps,
        examples=args.configs,
        timeout_s=args.timeout,
        wan=args.wan,
        overlap=args.overlap,
        task_options=args.task_options,
        chaos=args.chaos,
        workers=args.workers,
    )
    try:
        asyncio.run(_stoppable(run_demo(options, echo=lambda line: print(line, flush=True))))
    except (DemoFailed, DemoConfigError, ChildFailed) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted; the demo's processes were stopped", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


async def _stoppable(demo: Coroutine[Any, Any, object]) -> None:
    """Run ``demo``, which SIGTERM stops as Ctrl-C does: its federation is stopped in order."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        await demo
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
