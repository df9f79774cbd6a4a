"""One Slurm task of a worker group: find the head node, then become its elastic launcher.

``srun`` starts ``python -m regional_agent.launch.slurm_node [--scontrol PATH] -- ARGV`` once
per node (:mod:`regional_agent.launch.slurm`). The nodes are known only inside the job
step, so ``ARGV`` (a ``torch.distributed.run`` command line) names the head as
``{head}``: this fills in the address of the step's first node (``NodeAddr`` in Slurm's
node table), marks the first task as the rendezvous host, and execs it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

from regional_agent.launch.spec import first_host, node_addr, node_argv


def head_address(scontrol: str, environ: dict[str, str]) -> str:
    """The address of the job step's first node, as Slurm's node table gives it."""
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise SystemExit("slurm_node: neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set")
    hostnames = subprocess.run(
        [scontrol, "show", "hostnames", nodelist],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    host = first_host(hostnames)
    shown = subprocess.run(
        [scontrol, "show", "node", "-o", host],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return node_addr(shown, host)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m regional_agent.launch.slurm_node")
    parser.add_argument("--scontrol", default="scontrol")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run after --")
    environ = dict(os.environ)
    resolved = node_argv(command, head_address(args.scontrol, environ), environ)
    sys.stdout.flush()
    # Replaced by the elastic launcher: srun signals and waits for it directly.
    os.execvp(resolved[0], resolved)  # noqa: S606


if __name__ == "__main__":
    sys.exit(main())
