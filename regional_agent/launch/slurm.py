"""The ``slurm`` launcher backend: a worker group spanning the nodes of a Slurm job step.

The agent runs on the region's head node inside an allocation (``SLURM_JOB_ID`` set, e.g.
an ``sbatch`` script), or outside one, when ``srun`` requests the allocation itself and
blocks until it is granted. Either way one ``srun`` starts one task per node
(``--ntasks-per-node=1``), each an elastic launcher (``torch.distributed.run``, by way of
:mod:`regional_agent.launch.slurm_node`) with ``nproc_per_node`` ranks; they meet in a c10d
rendezvous at the step's first node. That node's ranks come first, so rank 0, the one
that reads the hand-off directory, is there: inside an allocation it is the agent's own
node (the batch host); an agent outside the allocation needs its state directory on a
filesystem that node shares.

Recovery is the elastic launchers': a rank that dies makes every node restart its ranks,
which resume from the regional checkpoint that rank 0 writes (up to ``max_restarts``);
when the step ends anyway, the worker group supervisor starts a new one, as for one node.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from regional_agent.handoff.settings import HEAD_SLURM_TASK_ENV, LauncherConfigError
from regional_agent.launch.launcher import LocalElasticLauncher, LocalLauncherConfig
from regional_agent.launch.spec import (
    HEAD_PLACEHOLDER,
    ElasticSpec,
    SrunSpec,
    elastic_command,
    forks_ranks,
    srun_command,
)

_STEP_KILL_WAIT_S = 10.0


@dataclass(frozen=True, slots=True)
class SlurmOptions:
    """What the agent asks of Slurm beyond the group's shape."""

    rdzv_port: int = 29400
    """Port of the rendezvous at the step's first node."""
    partition: str | None = None
    """For an allocation srun requests (the agent outside one); None: Slurm's default."""
    time_limit: str | None = None
    extra_args: tuple[str, ...] = ()
    """More srun options, e.g. ``--gpus-per-node=8`` or ``--account=...``."""
    srun: str = "srun"
    scontrol: str = "scontrol"
    job_id: str | None = field(default=None)
    """The allocation to run in; None: ``SLURM_JOB_ID`` of the agent's environment."""

    def __post_init__(self) -> None:
        if not 0 < self.rdzv_port < 65536:
            raise LauncherConfigError(f"rdzv_port must be 1-65535, got {self.rdzv_port!r}")


class SlurmLauncher(LocalElasticLauncher):
    """Runs the worker group as one ``srun`` job step of ``nnodes`` tasks."""

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        config: LocalLauncherConfig,
        slurm: SlurmOptions,
        *,
        environ: Mapping[str, str] | None = None,
        gpu_count: Callable[[], int] = torch.cuda.device_count,
        launcher_options: frozenset[str] | None = None,
    ) -> None:
        """``config`` gives the group's shape (``nnodes``, ``nproc_per_node``, ...); its
        rendezvous endpoint and id are the step's own and must be left unset."""
        super().__init__(
            workdir,
            config,
            environ=environ,
            gpu_count=gpu_count,
            launcher_options=launcher_options,
        )
        self._slurm = slurm
        self._excluded: frozenset[str] = frozenset()

    def exclude(self, nodes: frozenset[str]) -> None:
        """Run the next step without ``nodes`` (Slurm node names), on as many fewer nodes."""
        if len(nodes) >= self._config.nnodes:
            raise LauncherConfigError(
                f"cannot leave out {len(nodes)} of the group's {self._config.nnodes} nodes"
            )
        self._excluded = frozenset(nodes)

    @property
    def excluded(self) -> frozenset[str]:
        return self._excluded

    @property
    def nnodes(self) -> int:
        """The nodes of the next step: the group's, less those left out."""
        return self._config.nnodes - len(self._excluded)

    @property
    def world_size(self) -> int:
        return self.ranks.count * self.nnodes

    @staticmethod
    def _check_rendezvous(config: LocalLauncherConfig) -> None:
        if config.rdzv_endpoint is not None or config.rdzv_id is not None:
            raise LauncherConfigError(
                "the slurm launcher sets the rendezvous itself (the step's first node, "
                "port rdzv_port); leave rdzv_endpoint unset"
            )

    def command(self, port: int, launch_id: str) -> list[str]:
        """``srun ... python -m regional_agent.launch.slurm_node -- python -m torch.distributed.run
        ...`` (``regional_agent.launch.forking_run`` for gloo; ``port`` is unused: the
        rendezvous is at the first node's ``rdzv_port``)."""
        del port
        cfg, slurm = self._config, self._slurm
        elastic = elastic_command(
            cfg.python,
            self._flags.spelled,
            ElasticSpec(
                nnodes=self.nnodes,
                nproc_per_node=self.ranks.count,
                rdzv_endpoint=f"{HEAD_PLACEHOLDER}:{slurm.rdzv_port}",
                rdzv_id=launch_id,
                max_restarts=cfg.max_restarts,
                monitor_interval_s=cfg.monitor_interval_s,
                shutdown_timeout_s=cfg.shutdown_timeout_s,
                # Rewritten per task: the first hosts, the others join.
                is_host=True,
            ),
            self.settings.to_argv(),
            fork=forks_ranks(self.settings.backend),
        )
        node = [cfg.python, "-m", "regional_agent.launch.slurm_node", "--scontrol", slurm.scontrol]
        environ = os.environ if self._environ is None else self._environ
        spec = SrunSpec(
            nnodes=self.nnodes,
            job_id=slurm.job_id or environ.get("SLURM_JOB_ID"),
            job_name=f"geofed-{launch_id}",
            partition=slurm.partition,
            time_limit=slurm.time_limit,
            extra_args=slurm.extra_args,
            exclude=tuple(sorted(self._excluded)),
        )
        return srun_command(slurm.srun, spec, [*node, "--", *elastic])

    def environment(self, launch_id: str) -> dict[str, str]:
        env = super().environment(launch_id)
        env[HEAD_SLURM_TASK_ENV] = "0"
        return env

    def kill(self) -> None:
        """End the job step (two SIGINTs within a second make srun kill every task of
        it, on every node), then whatever of it is left on this node."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            for _ in range(2):
                proc.send_signal(signal.SIGINT)
                time.sleep(0.2)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_STEP_KILL_WAIT_S)
        super().kill()
