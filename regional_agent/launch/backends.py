"""The launcher backend the agent's ``workers.launcher`` names, built from its config."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from regional_agent.config import WorkersConfig
from regional_agent.launch.launcher import Launcher, LocalElasticLauncher
from regional_agent.launch.slurm import SlurmLauncher, SlurmOptions


def make_launcher(
    workers: WorkersConfig,
    workdir: Path,
    *,
    environ: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Launcher:
    """``local`` (this node; the head of a multi-node group) or ``slurm`` (``srun``).

    ``environ`` is the workers' base environment (default: the agent's own); the
    ``workers.env_passthrough`` variables are read from the agent's own environment.
    """
    config = workers.launcher_config(cwd=cwd, environ=os.environ)
    if workers.launcher == "slurm":
        slurm = workers.slurm
        options = SlurmOptions(
            rdzv_port=slurm.rdzv_port,
            partition=slurm.partition,
            time_limit=slurm.time_limit,
            extra_args=slurm.extra_args,
        )
        return SlurmLauncher(workdir, config, options, environ=environ)
    return LocalElasticLauncher(workdir, config, environ=environ)
