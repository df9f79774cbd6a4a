"""The launcher's command line parses with the installed torch's own parser; a flag that
torch lacks is dropped (optional) or refused (required)."""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from regional_agent.handoff.settings import LauncherConfigError
from regional_agent.launch import forking_run
from regional_agent.launch.flags import (
    Flag,
    FlagSpelling,
    MissingLauncherFlag,
    installed_options,
    spell_flags,
)
from regional_agent.launch.launcher import LocalElasticLauncher, LocalLauncherConfig
from regional_agent.launch.spec import RANK_MODULE, forks_ranks, is_launcher_command

CONFIG = LocalLauncherConfig(
    nproc_per_node=3, max_restarts=2, backend="gloo", monitor_interval_s=0.25, shutdown_timeout_s=7
)


def test_the_command_parses_with_the_installed_torch_parser(tmp_path: Path) -> None:
    launcher = LocalElasticLauncher(tmp_path, CONFIG, environ={})
    command = launcher.command(port=29123, launch_id="abc")
    # A gloo group's launcher forks its ranks; it takes torch's own command line.
    assert command[:3] == [sys.executable, "-m", "regional_agent.launch.forking_run"]
    args = get_args_parser().parse_args(command[3:])
    assert (args.nnodes, args.nproc_per_node) == ("1", "3")
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == (
        "c10d",
        "127.0.0.1:29123",
        "abc",
    )
    assert (args.max_restarts, args.monitor_interval) == (2, 0.25)
    assert args.module is True
    assert args.training_script == "regional_agent.worker.rank"
    assert args.training_script_args == launcher.settings.to_argv()
    if "--shutdown-timeout" in installed_options():
        assert args.shutdown_timeout == 7


def test_an_optional_flag_torch_lacks_is_dropped_and_reported_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The installed torch's options less one stand in for torch 2.11's (no
    # --shutdown-timeout); no other test drops a flag, so none was reported before.
    older = installed_options() - {"--shutdown-timeout", "--shutdown_timeout"}
    with caplog.at_level(logging.WARNING, logger="regional_agent.launch.launcher"):
        first = LocalElasticLauncher(tmp_path, CONFIG, environ={}, launcher_options=older)
        LocalElasticLauncher(tmp_path, CONFIG, environ={}, launcher_options=older)
    command = first.command(port=29123, launch_id="abc")
    assert not [part for part in command if "shutdown" in part]
    assert get_args_parser().parse_args(command[3:]).training_script == "regional_agent.worker.rank"
    warnings = [r.getMessage() for r in caplog.records if "shutdown-timeout" in r.getMessage()]
    assert len(warnings) == 1
    assert "has no --shutdown-timeout option; launching without it" in warnings[0]


def test_a_required_flag_torch_lacks_is_an_error(tmp_path: Path) -> None:
    without = installed_options() - {"--rdzv-endpoint", "--rdzv_endpoint"}
    with pytest.raises(LauncherConfigError, match="has no --rdzv-endpoint option"):
        LocalElasticLauncher(tmp_path, CONFIG, environ={}, launcher_options=without)


def test_spell_flags_prefers_hyphens_and_falls_back_to_underscores() -> None:
    flags = [Flag("nproc-per-node"), Flag("max-restarts"), Flag("shutdown-timeout", required=False)]
    accepted = {"--nproc-per-node", "--nproc_per_node", "--max_restarts"}
    assert spell_flags(flags, accepted) == FlagSpelling(
        {"nproc-per-node": "--nproc-per-node", "max-restarts": "--max_restarts"},
        ("shutdown-timeout",),
    )
    with pytest.raises(MissingLauncherFlag, match="no --max-restarts option"):
        spell_flags(flags, {"--nproc-per-node"})


def test_a_collective_timeout_shorter_than_an_idle_meeting_is_refused(tmp_path: Path) -> None:
    """Idle ranks wait in a collective for up to half a second between meetings."""
    short = dataclasses.replace(CONFIG, collective_timeout_s=1.0)
    with pytest.raises(LauncherConfigError, match=r"collective_timeout_s must be >= 5 s"):
        LocalElasticLauncher(tmp_path, short, environ={})


def test_an_nccl_group_keeps_torchs_launcher_whose_ranks_are_fresh_interpreters(
    tmp_path: Path,
) -> None:
    # A CUDA process must not fork: only CPU groups fork their ranks.
    config = LocalLauncherConfig(nproc_per_node=2, max_restarts=2, backend="nccl")
    launcher = LocalElasticLauncher(tmp_path, config, environ={}, gpu_count=lambda: 2)
    command = launcher.command(port=29123, launch_id="abc")
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert get_args_parser().parse_args(command[3:]).training_script == RANK_MODULE


def test_only_cpu_groups_fork_their_ranks() -> None:
    assert forks_ranks("gloo")
    assert not forks_ranks("nccl")


def test_launcher_command_lines_are_told_from_others() -> None:
    assert is_launcher_command("python -m torch.distributed.run --nnodes=1 -m x")
    assert is_launcher_command("python -m regional_agent.launch.forking_run -m x --workdir /w")
    assert not is_launcher_command("python -m regional_agent.worker.rank --workdir /w")
    assert not is_launcher_command("python -m geofed_cli agent --config a.yaml")


def test_the_forking_launcher_forks_the_rank_module_only() -> None:
    # It forks into the rank's main, which it imported: any other script is refused.
    with pytest.raises(SystemExit, match=r"launches --module regional_agent\.worker\.rank only"):
        forking_run.main(["--nproc-per-node=1", "--module", "other.module"])
    with pytest.raises(SystemExit, match=r"not 'train\.py'"):
        forking_run.main(["--nproc-per-node=1", "train.py"])
