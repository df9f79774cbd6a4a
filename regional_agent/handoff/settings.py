"""How a worker process is started: its command line, its environment, its backend.

The agent's launchers write these (:mod:`regional_agent.launch`), each rank reads them
(:mod:`regional_agent.worker.rank`): :class:`WorkerSettings` is the worker's command line,
the environment variables name the launch and the node that holds the hand-off directory.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

LAUNCH_ID_ENV = "GEOFED_LAUNCH_ID"
BACKENDS = ("gloo", "nccl")

DEFAULT_REGIONAL_CHECKPOINT_EVERY = 8
"""Rounds between saves of the inner optimizer state: with θ written whole every
``transfer.theta_file_every`` (8) rounds, a region writes under 4 bytes a parameter a
round. A crash between saves costs the optimizer steps since the last one, never θ."""

HEAD_NODE_ENV = "GEOFED_HEAD_NODE"
"""``1`` on the node whose ranks may read the hand-off directory (the agent's), ``0`` on
the others; unset: every node may (one node)."""
HEAD_SLURM_TASK_ENV = "GEOFED_HEAD_SLURM_PROCID"
"""Under ``srun`` (one task per node): the node is the head when its ``SLURM_PROCID``
equals this."""


class LauncherError(Exception):
    """A worker group could not be started or stopped."""


class LauncherConfigError(LauncherError, ValueError):
    """The launcher or worker settings are invalid; the message names the setting."""


def resolve_backend(requested: str | None) -> str:
    """Return ``requested``, or ``nccl`` when CUDA is available and ``gloo`` otherwise."""
    if requested is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested not in BACKENDS:
        raise LauncherConfigError(f"backend must be one of {BACKENDS}, got {requested!r}")
    return requested


#: The shortest collective timeout the workers take: an idle group's ranks wait in a
#: collective for up to :data:`regional_agent.worker.idle_agreement.IDLE_AGREE_S` (0.5 s)
#: plus a poll, and a hand-off step (rank 0 reading θ) holds the others longer.
MIN_COLLECTIVE_TIMEOUT_S = 5.0


def require_positive(what: str, value: float) -> None:
    """Raise :class:`LauncherConfigError` unless ``value`` is a finite number above zero."""
    if isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise LauncherConfigError(f"{what} must be a positive number, got {value!r}")


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """How each worker runs; passed on the worker's command line."""

    workdir: Path
    backend: str
    num_threads: int = 1
    poll_interval_s: float = 0.05
    progress_interval_s: float = 0.5
    collective_timeout_s: float = 600.0
    regional_checkpoint_every: int = DEFAULT_REGIONAL_CHECKPOINT_EVERY

    def __post_init__(self) -> None:
        resolve_backend(self.backend)
        if isinstance(self.regional_checkpoint_every, bool) or self.regional_checkpoint_every < 1:
            raise LauncherConfigError(
                f"regional_checkpoint_every must be >= 1, got {self.regional_checkpoint_every!r}"
            )
        if isinstance(self.num_threads, bool) or self.num_threads < 1:
            raise LauncherConfigError(f"num_threads must be >= 1, got {self.num_threads!r}")
        require_positive("poll_interval_s", self.poll_interval_s)
        require_positive("progress_interval_s", self.progress_interval_s)
        require_positive("collective_timeout_s", self.collective_timeout_s)
        if self.collective_timeout_s < MIN_COLLECTIVE_TIMEOUT_S:
            raise LauncherConfigError(
                f"collective_timeout_s must be >= {MIN_COLLECTIVE_TIMEOUT_S:g} s (idle ranks "
                f"wait in a collective up to 0.5 s), got {self.collective_timeout_s!r}"
            )

    def to_argv(self) -> list[str]:
        return [
            "--workdir",
            str(self.workdir),
            "--backend",
            self.backend,
            "--num-threads",
            str(self.num_threads),
            "--poll-interval-s",
            repr(self.poll_interval_s),
            "--progress-interval-s",
            repr(self.progress_interval_s),
            "--collective-timeout-s",
            repr(self.collective_timeout_s),
            "--regional-checkpoint-every",
            str(self.regional_checkpoint_every),
        ]

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None) -> WorkerSettings:
        """Parse a worker command line; exits with status 2 on bad arguments."""
        parser = argparse.ArgumentParser(prog="python -m regional_agent.worker.rank")
        parser.add_argument("--workdir", type=Path, required=True)
        parser.add_argument("--backend", choices=BACKENDS, required=True)
        parser.add_argument("--num-threads", type=int, default=1)
        parser.add_argument("--poll-interval-s", type=float, default=0.05)
        parser.add_argument("--progress-interval-s", type=float, default=0.5)
        parser.add_argument("--collective-timeout-s", type=float, default=600.0)
        parser.add_argument("--regional-checkpoint-every", type=int, default=4)
        args = parser.parse_args(argv)
        try:
            return cls(
                workdir=args.workdir,
                backend=args.backend,
                num_threads=args.num_threads,
                poll_interval_s=args.poll_interval_s,
                progress_interval_s=args.progress_interval_s,
                collective_timeout_s=args.collective_timeout_s,
                regional_checkpoint_every=args.regional_checkpoint_every,
            )
        except LauncherConfigError as exc:
            parser.error(str(exc))


def is_head_node(environ: Mapping[str, str]) -> bool:
    """Whether this rank's node holds the hand-off directory (see :data:`HEAD_NODE_ENV`)."""
    slurm_head = environ.get(HEAD_SLURM_TASK_ENV)
    if slurm_head is not None:
        return environ.get("SLURM_PROCID") == slurm_head
    return environ.get(HEAD_NODE_ENV, "1") != "0"


def head_first_ranks(heads: Sequence[bool]) -> list[int]:
    """New rank of each launcher-assigned rank: the head node's ranks first, in order.

    The elastic rendezvous orders nodes by host name and process id, so the agent's node
    need not get rank 0; rank 0 is the one rank that reads the hand-off directory, so the
    ranks are renumbered. With no head (or all heads) the order is unchanged.
    """
    order = [r for r, head in enumerate(heads) if head] + [
        r for r, head in enumerate(heads) if not head
    ]
    new = [0] * len(heads)
    for position, rank in enumerate(order):
        new[rank] = position
    return new
