"""A non-head node of a multi-node region: run this node's share of the worker group.

``python -m regional_agent.launch.node --workdir DIR --nnodes N --nproc-per-node P
--rdzv-endpoint HEAD:PORT --rdzv-id ID`` runs one elastic launcher that joins the head
node's c10d rendezvous (the agent's launcher hosts it) and exits with its status; run it
under systemd (``Restart=always``) on each fixed node of the region. ``DIR`` is node-local:
it holds only this node's rank logs and statuses, never an instruction or a parameter
(rank 0, on the head node, broadcasts those). Slurm regions need none of this: the agent
starts every node with ``srun`` (:mod:`regional_agent.launch.slurm`).
"""

from __future__ import annotations

import argparse
import logging
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from geofed.process_exit import exit_without_teardown
from regional_agent.handoff.settings import LauncherConfigError
from regional_agent.launch.launcher import LocalElasticLauncher, LocalLauncherConfig

log = logging.getLogger("regional_agent.launch.node")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m regional_agent.launch.node")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--nproc-per-node", default="auto")
    parser.add_argument("--rdzv-endpoint", required=True)
    parser.add_argument("--rdzv-id", required=True)
    parser.add_argument("--local-addr", default=None, help="this node's address for the others")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--collective-timeout-s", type=float, default=600.0)
    parser.add_argument("--poll-interval-s", type=float, default=0.05)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run this node's elastic launcher until it exits or a signal asks it to stop."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    count = args.nproc_per_node
    try:
        config = LocalLauncherConfig(
            nproc_per_node=count if count == "auto" else int(count),
            nnodes=args.nnodes,
            rdzv_endpoint=args.rdzv_endpoint,
            rdzv_id=args.rdzv_id,
            local_addr=args.local_addr,
            head=False,
            backend=args.backend,
            max_restarts=args.max_restarts,
            collective_timeout_s=args.collective_timeout_s,
            poll_interval_s=args.poll_interval_s,
        )
        launcher = LocalElasticLauncher(args.workdir, config)
    except (LauncherConfigError, ValueError) as exc:
        parser.error(str(exc))
    stopping: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        del frame
        stopping.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    args.workdir.mkdir(parents=True, exist_ok=True)
    launcher.start()
    while (status := launcher.poll()) is None:
        if stopping:
            launcher.terminate()
            break
        time.sleep(0.2)
    if status is None:
        deadline = time.monotonic() + config.shutdown_timeout_s + 5
        while (status := launcher.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.1)
    launcher.kill()
    log.info("node launcher exited with status %s", status)
    return 1 if status is None else status


if __name__ == "__main__":
    exit_without_teardown(main())
