"""Starting and stopping a region's worker group: the launcher interface and the local one.

A :class:`Launcher` runs ``regional_agent.worker.rank`` on every rank of the region and
knows how to stop all of it; the worker group supervisor needs nothing else, so a
Slurm or Kubernetes launcher can replace :class:`LocalElasticLauncher` for multi-node
regions.

:class:`LocalElasticLauncher` runs torch's elastic launcher (``torch.distributed.run``;
for a gloo group :mod:`regional_agent.launch.forking_run`, which forks the ranks with
their imports done) as one child process in its own session. The elastic launcher
restarts the whole local group in place (up to ``max_restarts`` times) when a worker
dies, which keeps its rendezvous store and avoids paying its own interpreter and torch
import again. ``torch.distributed.run`` starts every worker in a session of its own, so
stopping is done per process tree, not by one process-group signal.

No worker outlives the agent. On Linux the elastic launcher is started with a parent-death
signal (``PR_SET_PDEATHSIG``, SIGTERM): when the agent exits by any path, SIGKILL
included, the kernel sends it SIGTERM and it stops its workers (SIGKILL after its
shutdown timeout); a worker whose launcher is gone stops by itself
(:class:`regional_agent.worker.rank.StopSignals`). The signal follows the agent's thread that
started the launcher: the event loop's thread pool, whose threads live as long as the
loop. A launcher left by an agent on another system is reaped by the next agent's start.

Backend: ``nccl`` when CUDA is available, else ``gloo``. Each CUDA rank uses
``cuda:<local_rank>``, and NCCL refuses two ranks on one GPU: the rank count, ``auto`` by
default, is decided by :func:`regional_agent.launch.ranks.choose_ranks` (one rank per GPU the
workers see on nccl, 2 on gloo) and logged with its reason. The command line carries
only options the installed ``torch.distributed.run`` accepts
(:mod:`regional_agent.launch.flags`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from geofed.heap import rank_heap_environment
from geofed.parent_death import die_with_parent
from geofed.ports import unused_port
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.settings import (
    DEFAULT_REGIONAL_CHECKPOINT_EVERY,
    HEAD_NODE_ENV,
    HEAD_SLURM_TASK_ENV,
    LAUNCH_ID_ENV,
    LauncherConfigError,
    LauncherError,
    WorkerSettings,
    require_positive,
    resolve_backend,
)
from regional_agent.launch.flags import (
    Flag,
    FlagSpelling,
    MissingLauncherFlag,
    installed_options,
    spell_flags,
)
from regional_agent.launch.ranks import (
    AUTO,
    RankChoice,
    RankCountError,
    choose_ranks,
    visible_gpu_count,
)
from regional_agent.launch.spec import (
    RANK_MODULE,
    ElasticSpec,
    elastic_command,
    forks_ranks,
    is_launcher_command,
    parse_endpoint,
)

log = logging.getLogger(__name__)

# Set by the launcher itself; a region's environment may not override them.
_RESERVED_ENV = frozenset(
    {
        "OMP_NUM_THREADS",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        LAUNCH_ID_ENV,
        HEAD_NODE_ENV,
        HEAD_SLURM_TASK_ENV,
    }
)
_KILL_WAIT_S = 10.0
# The elastic launcher's options, by hyphenated name; spelled per the installed torch.
_FLAGS = (
    Flag("nnodes"),
    Flag("nproc-per-node"),
    Flag("rdzv-backend"),
    Flag("rdzv-endpoint"),
    Flag("rdzv-id"),
    Flag("max-restarts"),
    Flag("monitor-interval", required=False),
    Flag("shutdown-timeout", required=False),
    Flag("rdzv-conf", required=False),
    Flag("local-addr", required=False),
    Flag("module"),
)
# Optional flags already reported missing: one warning per process, not one per launch.
_REPORTED_DROPS: set[str] = set()


class Launcher(ABC):
    """Runs one worker group over a hand-off directory; may be started again after it ends."""

    @abstractmethod
    def start(self) -> None:
        """Start the group; raises :class:`LauncherError` if it is already running."""

    @abstractmethod
    def poll(self) -> int | None:
        """Return the group's exit status once it has ended, else None. Never blocks."""

    @abstractmethod
    def terminate(self) -> None:
        """Ask the group to stop (workers finish or abort their step and exit 0)."""

    @abstractmethod
    def kill(self) -> None:
        """Kill every process of the group now and wait until they are gone."""

    @property
    @abstractmethod
    def pid(self) -> int | None:
        """The launcher process's id while one is running."""

    @property
    @abstractmethod
    def launch_id(self) -> str | None:
        """Opaque id of the current launch; workers report it in their rank status."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Number of ranks the group runs."""

    @property
    @abstractmethod
    def restart_count(self) -> int:
        """Worker-group restarts the launcher itself performed, over all its launches."""


@dataclass(frozen=True, slots=True)
class LocalLauncherConfig:
    """Settings of :class:`LocalElasticLauncher` (one node of a group of ``nnodes``)."""

    nproc_per_node: int | Literal["auto"] = AUTO
    """Ranks to run: ``auto`` (one per visible GPU on nccl, 2 on gloo) or a count, at most
    the number of visible GPUs on nccl."""
    max_restarts: int = 3
    """In-place restarts of the whole group after a worker dies, before giving up."""
    backend: str | None = None
    """``gloo`` or ``nccl``; None picks nccl when CUDA is available."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment from the region config (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME...)."""
    num_threads: int = 1
    """``torch.set_num_threads`` in each worker."""
    omp_num_threads: int = 1
    poll_interval_s: float = 0.05
    """How often rank 0 looks for a new instruction or a stop request."""
    progress_interval_s: float = 0.5
    collective_timeout_s: float = 600.0
    """torch.distributed timeout; bounds how long a rank waits for a hung peer."""
    regional_checkpoint_every: int = DEFAULT_REGIONAL_CHECKPOINT_EVERY
    """Rounds between saves of the inner optimizer state (the head node's ranks decide)."""
    monitor_interval_s: float = 0.1
    shutdown_timeout_s: int = 20
    """How long the elastic launcher lets workers exit after SIGTERM before SIGKILL (left
    to torch's default where the installed torch has no ``--shutdown-timeout``)."""
    python: str = sys.executable
    cwd: Path | None = None
    nnodes: int = 1
    """Nodes of the group, each running one elastic launcher with ``nproc_per_node`` ranks."""
    rdzv_endpoint: str | None = None
    """``host:port`` of the c10d rendezvous, hosted by the head node's launcher; None (one
    node only): 127.0.0.1 and a free port."""
    rdzv_id: str | None = None
    """The rendezvous id every node's launcher gives (needed for ``nnodes`` > 1); None: a
    fresh id per launch."""
    local_addr: str | None = None
    """This node's address as the other nodes reach it (rendezvous and the workers' store);
    None: its fully qualified host name."""
    head: bool = True
    """Whether this node is the head: the agent's, where rank 0 runs and reads the hand-off
    directory. The other nodes' launchers (``python -m regional_agent.launch.node``) are not."""

    def __post_init__(self) -> None:
        count = self.nproc_per_node
        if count != AUTO and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise LauncherConfigError(
                f"nproc_per_node must be an integer >= 1 or {AUTO!r}, got {count!r}"
            )
        for name in ("num_threads", "omp_num_threads", "shutdown_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LauncherConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.max_restarts, bool) or self.max_restarts < 0:
            raise LauncherConfigError(f"max_restarts must be >= 0, got {self.max_restarts!r}")
        require_positive("monitor_interval_s", self.monitor_interval_s)
        if isinstance(self.nnodes, bool) or not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise LauncherConfigError(f"nnodes must be an integer >= 1, got {self.nnodes!r}")
        if self.rdzv_endpoint is not None:
            try:
                parse_endpoint(self.rdzv_endpoint)
            except ValueError as exc:
                raise LauncherConfigError(f"rdzv_endpoint: {exc}") from None
        for key, value in self.env.items():
            if not isinstance(key, str) or not isinstance(value, str) or not key:
                raise LauncherConfigError(f"env entries must be strings: {key!r}={value!r}")
            if key in _RESERVED_ENV:
                raise LauncherConfigError(f"env may not set {key}: the launcher sets it")


class LocalElasticLauncher(Launcher):
    """Runs ``torch.distributed.run`` with ``regional_agent.worker.rank`` on this machine."""

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        config: LocalLauncherConfig,
        *,
        environ: Mapping[str, str] | None = None,
        gpu_count: Callable[[], int] = torch.cuda.device_count,
        launcher_options: frozenset[str] | None = None,
    ) -> None:
        """``environ`` is the workers' base environment (default: this process's at start).

        ``gpu_count`` and ``launcher_options`` are the machine's edges: the GPUs this
        process sees, and the options of the installed ``torch.distributed.run`` (read
        from its parser when None).
        """
        self._check_rendezvous(config)
        self._handoff = HandoffDir(Path(workdir).resolve())
        self._config = config
        self._environ = None if environ is None else dict(environ)
        backend = resolve_backend(config.backend)
        self.ranks = _choose_ranks(config, backend, self._environ, gpu_count)
        log.info("worker group: %d %s ranks (%s)", self.ranks.count, backend, self.ranks.reason)
        self._flags = _spell_flags(
            installed_options() if launcher_options is None else launcher_options
        )
        self.settings = WorkerSettings(
            workdir=self._handoff.root,
            backend=backend,
            num_threads=config.num_threads,
            poll_interval_s=config.poll_interval_s,
            progress_interval_s=config.progress_interval_s,
            collective_timeout_s=config.collective_timeout_s,
            regional_checkpoint_every=config.regional_checkpoint_every,
        )
        self._proc: subprocess.Popen[bytes] | None = None
        self._launch_id: str | None = None
        self._past_restarts = 0

    @staticmethod
    def _check_rendezvous(config: LocalLauncherConfig) -> None:
        """Several nodes meet only at an endpoint and id that all of them are given."""
        if config.nnodes > 1 and (config.rdzv_endpoint is None or not config.rdzv_id):
            raise LauncherConfigError(
                "nnodes > 1 needs rdzv_endpoint (host:port of the head node) and rdzv_id"
            )

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def launch_id(self) -> str | None:
        return self._launch_id

    @property
    def world_size(self) -> int:
        return self.ranks.count * self._config.nnodes

    @property
    def restart_count(self) -> int:
        return self._past_restarts + self._current_restarts()

    def elastic_spec(self, port: int, launch_id: str) -> ElasticSpec:
        """This node's elastic launcher settings for a launch (``port``: one node only)."""
        cfg = self._config
        multi = cfg.nnodes > 1
        return ElasticSpec(
            nnodes=cfg.nnodes,
            nproc_per_node=self.ranks.count,
            rdzv_endpoint=cfg.rdzv_endpoint or f"127.0.0.1:{port}",
            rdzv_id=cfg.rdzv_id or launch_id,
            max_restarts=cfg.max_restarts,
            monitor_interval_s=cfg.monitor_interval_s,
            shutdown_timeout_s=cfg.shutdown_timeout_s,
            # Several nodes on one host (or an endpoint given by address) must not all host.
            is_host=cfg.head if multi else None,
            local_addr=cfg.local_addr,
        )

    def command(self, port: int, launch_id: str) -> list[str]:
        """The elastic launcher's command line (rendezvous on ``port`` for one node)."""
        return elastic_command(
            self._config.python,
            self._flags.spelled,
            self.elastic_spec(port, launch_id),
            self.settings.to_argv(),
            fork=forks_ranks(self.settings.backend),
        )

    def environment(self, launch_id: str) -> dict[str, str]:
        env = dict(os.environ if self._environ is None else self._environ)
        env.update(self._config.env)
        # Where neither the agent's environment nor the region's sets them.
        env.update(rank_heap_environment(env))
        env["OMP_NUM_THREADS"] = str(self._config.omp_num_threads)
        env["PYTHONUNBUFFERED"] = "1"
        env[LAUNCH_ID_ENV] = launch_id
        env[HEAD_NODE_ENV] = "1" if self._config.head else "0"
        # Workers get their own TCPStore per restart: with the store shared with the
        # rendezvous, a restarted rank can read the previous attempt's peer addresses
        # and fail to connect (pytorch/pytorch#135712).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        return env

    def start(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            raise LauncherError(f"worker group already running (launcher pid {self._proc.pid})")
        self._finish_previous()
        self._reap_stale()
        launch_id = secrets.token_hex(8)
        self._handoff.log_dir.mkdir(parents=True, exist_ok=True)
        # The child keeps its own descriptor of the log; ours is closed right away.
        with self._handoff.launcher_log_path.open("ab") as log_file:
            log_file.write(f"=== launch {launch_id} at {time.ctime()} ===\n".encode())
            log_file.flush()
            try:
                proc = subprocess.Popen(
                    self.command(unused_port(), launch_id),
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=self.environment(launch_id),
                    cwd=self._config.cwd,
                    start_new_session=True,
                    preexec_fn=die_with_parent(os.getpid()),
                )
            except OSError as exc:
                raise LauncherError(f"cannot start the elastic launcher: {exc}") from exc
        self._proc, self._launch_id = proc, launch_id
        self._pid_file.write_text(f"{proc.pid} {launch_id}\n")
        log.info("started worker group launch %s (launcher pid %d)", launch_id, proc.pid)

    def poll(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def terminate(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            # The elastic launcher forwards SIGTERM to every worker.
            self._proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        victims = set(self.worker_pids().values())
        if self._proc is not None and self._proc.poll() is None:
            victims.add(self._proc.pid)
        killed = _kill_trees(victims)
        if self._proc is not None:
            try:
                self._proc.wait(timeout=_KILL_WAIT_S)
            except subprocess.TimeoutExpired as exc:
                raise LauncherError(f"launcher pid {self._proc.pid} survived SIGKILL") from exc
        _wait_gone(killed)
        self._pid_file.unlink(missing_ok=True)

    def worker_pids(self) -> dict[int, int]:
        """Rank -> pid of this launch's live workers (as their rank status reports)."""
        pids: dict[int, int] = {}
        for status in self._handoff.read_rank_statuses():
            if status.launch_id == self._launch_id and self._is_worker(status.pid):
                pids[status.rank] = status.pid
        return pids

    @property
    def _pid_file(self) -> Path:
        return self._handoff.root / "launcher.pid"

    def _current_restarts(self) -> int:
        counts = [
            s.restart_count
            for s in self._handoff.read_rank_statuses()
            if s.launch_id == self._launch_id
        ]
        return max(counts, default=0)

    def _finish_previous(self) -> None:
        if self._proc is not None:
            self._past_restarts += self._current_restarts()
            self._proc, self._launch_id = None, None

    def _is_worker(self, pid: int) -> bool:
        cmdline = _cmdline(pid)
        return RANK_MODULE in cmdline and str(self._handoff.root) in cmdline

    def _reap_stale(self) -> None:
        """Kill a group a previous supervisor of this work dir left running."""
        try:
            pid_text, stale_id = self._pid_file.read_text().split()
            stale_pid = int(pid_text)
        except (FileNotFoundError, ValueError):
            return
        victims = {
            s.pid
            for s in self._handoff.read_rank_statuses()
            if s.launch_id == stale_id and self._is_worker(s.pid)
        }
        cmdline = _cmdline(stale_pid)
        if is_launcher_command(cmdline) and str(self._handoff.root) in cmdline:
            victims.add(stale_pid)
        if victims:
            log.warning("killing worker group left running by a previous supervisor: %s", victims)
            _wait_gone(_kill_trees(victims))
        self._pid_file.unlink(missing_ok=True)


def _choose_ranks(
    config: LocalLauncherConfig,
    backend: str,
    environ: Mapping[str, str] | None,
    gpu_count: Callable[[], int],
) -> RankChoice:
    own = os.environ
    workers_env = {**(own if environ is None else environ), **config.env}
    gpus = 0
    if backend == "nccl":
        gpus = visible_gpu_count(workers_env, own, gpu_count())
    try:
        return choose_ranks(config.nproc_per_node, backend, gpus)
    except RankCountError as exc:
        raise LauncherConfigError(str(exc)) from None


def _spell_flags(options: frozenset[str]) -> FlagSpelling:
    try:
        spelling = spell_flags(_FLAGS, options)
    except MissingLauncherFlag as exc:
        raise LauncherConfigError(str(exc)) from None
    for name in spelling.dropped:
        if name not in _REPORTED_DROPS:
            _REPORTED_DROPS.add(name)
            log.warning(
                "the installed torch.distributed.run (torch %s) has no --%s option; "
                "launching without it (torch's default applies)",
                torch.__version__,
                name,
            )
    return spelling


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def descendants(pids: Iterable[int]) -> set[int]:
    """``pids`` and every process below them (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[-1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def _kill_trees(roots: Iterable[int]) -> set[int]:
    """SIGKILL ``roots`` and everything below them; return the processes signalled."""
    victims = descendants(roots)
    for pid in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            # The launcher and each worker lead their own process group; sweep it too.
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
    return victims


def _wait_gone(pids: Iterable[int]) -> None:
    pending = set(pids)
    deadline = time.monotonic() + _KILL_WAIT_S
    while pending and time.monotonic() < deadline:
        pending = {pid for pid in pending if _alive(pid)}
        if pending:
            time.sleep(0.02)
    if pending:
        raise LauncherError(f"processes {sorted(pending)} survived SIGKILL")
