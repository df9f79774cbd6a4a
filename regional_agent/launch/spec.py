"""Pure parts of launching a worker group across nodes: command lines and environment.

Nothing here starts a process or reads the machine: the launchers
(:mod:`regional_agent.launch.launcher`, :mod:`regional_agent.launch.slurm`) pass the
environment and the installed launcher's flag spellings in, so every command line is
unit-tested without processes.

A group of ``nnodes`` nodes runs one elastic launcher per node (``torch.distributed.run``;
for CPU groups :mod:`regional_agent.launch.forking_run`, which forks the ranks); they meet
in a c10d rendezvous hosted at the head node's ``rdzv_endpoint``. The head node is the one
whose ranks may read the hand-off directory (the agent's); its ranks come first
(:func:`head_first_ranks`), so rank 0, the one rank that talks to the agent, is there.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from regional_agent.handoff.settings import is_head_node

HEAD_PLACEHOLDER = "{head}"
"""Stands for the head node's address in a command line built before the nodes are known."""

RANK_MODULE = "regional_agent.worker.rank"
"""The module every rank runs."""
ELASTIC_RUN = "torch.distributed.run"
"""torch's elastic launcher: ranks are fresh interpreters (NCCL groups)."""
FORKING_RUN = "regional_agent.launch.forking_run"
"""The same launcher with the ranks forked from it, their imports done (gloo groups)."""

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENV_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\*?$")


def parse_endpoint(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port); ValueError says what is wrong."""
    host, sep, port_text = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or any(c.isspace() or c == "/" for c in host):
        raise ValueError(f"{text!r} is not host:port")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{text!r}: the port must be 1-65535")
    return host, int(port_text)


def check_env_patterns(patterns: Sequence[str]) -> None:
    """Each entry is a variable name or a name prefix ending in ``*`` (``NCCL_*``)."""
    for pattern in patterns:
        if not _ENV_PATTERN.fullmatch(pattern):
            raise ValueError(f"{pattern!r} is not a variable name or a NAME_PREFIX* pattern")


def passthrough_env(environ: Mapping[str, str], patterns: Sequence[str]) -> dict[str, str]:
    """The variables of ``environ`` that the allow-list ``patterns`` names."""
    return {
        name: value
        for name, value in environ.items()
        if _ENV_NAME.fullmatch(name)
        and any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
    }


@dataclass(frozen=True, slots=True)
class ElasticSpec:
    """One node's elastic launcher settings."""

    nnodes: int
    nproc_per_node: int
    rdzv_endpoint: str
    rdzv_id: str
    max_restarts: int
    monitor_interval_s: float
    shutdown_timeout_s: int
    is_host: bool | None = None
    """Whether this node hosts the rendezvous store; None: torch decides by host name."""
    local_addr: str | None = None
    """This node's address as the others reach it; None: its fully qualified host name."""


def elastic_values(spec: ElasticSpec) -> dict[str, str]:
    """The elastic launcher's options (hyphenated name -> value) for ``spec``."""
    values = {
        "nnodes": str(spec.nnodes),
        "nproc-per-node": str(spec.nproc_per_node),
        "rdzv-backend": "c10d",
        "rdzv-endpoint": spec.rdzv_endpoint,
        "rdzv-id": spec.rdzv_id,
        "max-restarts": str(spec.max_restarts),
        "monitor-interval": repr(spec.monitor_interval_s),
        "shutdown-timeout": str(spec.shutdown_timeout_s),
    }
    if spec.is_host is not None:
        values["rdzv-conf"] = f"is_host={int(spec.is_host)}"
    if spec.local_addr is not None:
        values["local-addr"] = spec.local_addr
    return values


def elastic_command(
    python: str,
    spelled: Mapping[str, str],
    spec: ElasticSpec,
    worker_argv: Sequence[str],
    *,
    fork: bool = False,
) -> list[str]:
    """``python -m torch.distributed.run ... -m regional_agent.worker.rank ...`` for ``spec``
    (``-m regional_agent.launch.forking_run`` with ``fork``: the ranks are forked from the
    launcher, their imports done; CPU groups only).

    ``spelled`` maps each flag name to the installed launcher's spelling; flags it lacks
    are left out (torch's default applies).
    """
    options = [
        f"{spelled[name]}={value}"
        for name, value in elastic_values(spec).items()
        if name in spelled
    ]
    # A store-true flag: the script that follows is a module name.
    return [
        python,
        "-m",
        FORKING_RUN if fork else ELASTIC_RUN,
        *options,
        spelled["module"],
        RANK_MODULE,
        *worker_argv,
    ]


def forks_ranks(backend: str) -> bool:
    """Whether a group on ``backend`` forks its ranks from its launcher
    (:data:`FORKING_RUN`): gloo (CPU) groups only, since a process must not fork once CUDA
    is initialised."""
    return backend == "gloo"


def is_launcher_command(cmdline: str) -> bool:
    """Whether a process's command line (``/proc/PID/cmdline``, NULs as spaces) is an
    elastic launcher's. A rank forked by :data:`FORKING_RUN` has its launcher's command
    line too: tell them apart by descent."""
    return any(module in cmdline for module in (ELASTIC_RUN, FORKING_RUN))


@dataclass(frozen=True, slots=True)
class SrunSpec:
    """How the agent asks Slurm for the worker group's job step."""

    nnodes: int
    job_id: str | None
    """The allocation the agent runs in (``SLURM_JOB_ID``); None: srun requests one."""
    job_name: str
    partition: str | None = None
    time_limit: str | None = None
    extra_args: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    """Nodes the step must not run on (stragglers left out)."""


def srun_command(srun: str, spec: SrunSpec, node_command: Sequence[str]) -> list[str]:
    """``srun`` running ``node_command`` once on each of ``spec.nnodes`` nodes.

    One task per node (each runs an elastic launcher that starts the node's ranks), all
    of the node's CPUs for it, every variable of srun's environment exported, and no
    kill of the step when one task exits: the elastic launchers restart the group.
    """
    argv = [
        srun,
        f"--nodes={spec.nnodes}",
        f"--ntasks={spec.nnodes}",
        "--ntasks-per-node=1",
        f"--job-name={spec.job_name}",
        "--export=ALL",
        "--kill-on-bad-exit=0",
        "--unbuffered",
    ]
    if spec.job_id is not None:
        argv += [f"--jobid={spec.job_id}", "--overlap"]
    if spec.partition is not None:
        argv.append(f"--partition={spec.partition}")
    if spec.time_limit is not None:
        argv.append(f"--time={spec.time_limit}")
    if spec.exclude:
        argv.append(f"--exclude={','.join(spec.exclude)}")
    return [*argv, *spec.extra_args, *node_command]


def node_argv(argv: Sequence[str], head_addr: str, environ: Mapping[str, str]) -> list[str]:
    """One Slurm task's elastic launcher command line: the head's address filled in, and
    ``is_host`` set on the head task only (two tasks on one host must not both host)."""
    head = is_head_node(environ)
    out: list[str] = []
    for arg in argv:
        arg = arg.replace(HEAD_PLACEHOLDER, head_addr)
        if arg.startswith(("--rdzv-conf=is_host=", "--rdzv_conf=is_host=")):
            arg = arg.split("=", 1)[0] + f"=is_host={int(head)}"
        out.append(arg)
    return out


def first_host(hostnames_output: str) -> str:
    """The first host of ``scontrol show hostnames`` output."""
    for line in hostnames_output.splitlines():
        if line.strip():
            return line.strip()
    raise ValueError("scontrol listed no host")


def node_addr(show_node_output: str, host: str) -> str:
    """``NodeAddr`` of ``scontrol show node -o HOST`` output (the host name if absent)."""
    for token in show_node_output.split():
        if token.startswith("NodeAddr="):
            return token.split("=", 1)[1] or host
    return host
