"""Multi-node launch without processes: command lines (local and srun), rank order, the
environment passed through, and the workers config that selects them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.run import get_args_parser

from geofed.heap import RANK_HEAP_ENV
from regional_agent.config import WorkersConfig, load_config
from regional_agent.handoff.settings import (
    HEAD_NODE_ENV,
    HEAD_SLURM_TASK_ENV,
    LauncherConfigError,
    head_first_ranks,
    is_head_node,
)
from regional_agent.launch.backends import make_launcher
from regional_agent.launch.launcher import LocalElasticLauncher, LocalLauncherConfig
from regional_agent.launch.slurm import SlurmLauncher, SlurmOptions
from regional_agent.launch.spec import (
    ELASTIC_RUN,
    FORKING_RUN,
    HEAD_PLACEHOLDER,
    SrunSpec,
    first_host,
    node_addr,
    node_argv,
    parse_endpoint,
    passthrough_env,
    srun_command,
)
from tests.support.agent_configs import federation, problems, write
from tests.support.pki import Federation

__all__ = ["federation"]  # the fixture, shared with the agent config tests


def cfg(**settings: Any) -> LocalLauncherConfig:
    """Two gloo ranks per node, 4 restarts, and ``settings``."""
    return LocalLauncherConfig(
        **{"nproc_per_node": 2, "backend": "gloo", "max_restarts": 4, **settings}
    )


def parsed(command: list[str]) -> argparse.Namespace:
    start = next(i for i, part in enumerate(command) if part in (ELASTIC_RUN, FORKING_RUN)) + 1
    return get_args_parser().parse_args(command[start:])


def test_head_first_ranks_puts_the_head_node_first_in_order() -> None:
    assert head_first_ranks([False, False, True, True]) == [2, 3, 0, 1]
    assert head_first_ranks([False, True]) == [1, 0]
    assert head_first_ranks([True, False, True]) == [0, 2, 1]
    assert head_first_ranks([False, False]) == [0, 1]  # no head: unchanged
    assert head_first_ranks([True, True]) == [0, 1]


def test_is_head_node_from_the_launcher_or_the_slurm_task() -> None:
    assert is_head_node({})  # one node
    assert is_head_node({HEAD_NODE_ENV: "1"})
    assert not is_head_node({HEAD_NODE_ENV: "0"})
    assert is_head_node({HEAD_SLURM_TASK_ENV: "0", "SLURM_PROCID": "0", HEAD_NODE_ENV: "0"})
    assert not is_head_node({HEAD_SLURM_TASK_ENV: "0", "SLURM_PROCID": "1"})


def test_local_head_node_command_joins_a_multi_node_rendezvous(tmp_path: Path) -> None:
    config = cfg(nnodes=3, rdzv_endpoint="10.0.0.5:29500", rdzv_id="eu", local_addr="10.0.0.5")
    launcher = LocalElasticLauncher(tmp_path, config, environ={})
    args = parsed(launcher.command(port=1, launch_id="launch-1"))
    assert (args.nnodes, args.nproc_per_node, args.max_restarts) == ("3", "2", 4)
    assert (args.rdzv_endpoint, args.rdzv_id, args.rdzv_conf) == (
        "10.0.0.5:29500",
        "eu",
        "is_host=1",
    )
    assert args.local_addr == "10.0.0.5"
    assert launcher.world_size == 6
    assert launcher.environment("launch-1")[HEAD_NODE_ENV] == "1"
    other_config = cfg(nnodes=3, rdzv_endpoint="10.0.0.5:29500", rdzv_id="eu", head=False)
    other = LocalElasticLauncher(tmp_path, other_config, environ={})
    assert parsed(other.command(port=1, launch_id="x")).rdzv_conf == "is_host=0"
    assert other.environment("x")[HEAD_NODE_ENV] == "0"


def test_ranks_get_the_heap_settings_unless_the_agent_or_the_region_sets_them(
    tmp_path: Path,
) -> None:
    plain = LocalElasticLauncher(tmp_path, cfg(), environ={}).environment("x")
    assert {name: plain[name] for name in RANK_HEAP_ENV} == RANK_HEAP_ENV
    agents = LocalElasticLauncher(
        tmp_path, cfg(), environ={"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    ).environment("x")
    assert agents["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
    assert agents["MALLOC_MMAP_THRESHOLD_"] == RANK_HEAP_ENV["MALLOC_MMAP_THRESHOLD_"]
    regions = LocalElasticLauncher(
        tmp_path, cfg(env={"MALLOC_MMAP_THRESHOLD_": "131072"}), environ={}
    ).environment("x")
    assert regions["MALLOC_MMAP_THRESHOLD_"] == "131072"


def test_one_node_keeps_a_loopback_rendezvous_of_its_own(tmp_path: Path) -> None:
    launcher = LocalElasticLauncher(tmp_path, cfg(), environ={})
    args = parsed(launcher.command(port=29123, launch_id="abc"))
    assert (args.nnodes, args.rdzv_endpoint, args.rdzv_id) == ("1", "127.0.0.1:29123", "abc")
    assert args.rdzv_conf == ""
    assert launcher.world_size == 2


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"nnodes": 2}, "nnodes > 1 needs rdzv_endpoint"),
        ({"nnodes": 2, "rdzv_endpoint": "h:1"}, "nnodes > 1 needs rdzv_endpoint"),
        ({"nnodes": 0}, "nnodes must be an integer >= 1"),
        ({"rdzv_endpoint": "no-port"}, "rdzv_endpoint: 'no-port' is not host:port"),
        ({"env": {HEAD_NODE_ENV: "1"}}, f"env may not set {HEAD_NODE_ENV}"),
    ],
)
def test_bad_multi_node_settings_are_refused(
    tmp_path: Path, settings: dict[str, object], message: str
) -> None:
    with pytest.raises(LauncherConfigError, match=message):
        LocalElasticLauncher(tmp_path, cfg(**settings), environ={})


def test_parse_endpoint() -> None:
    assert parse_endpoint("head.example:29400") == ("head.example", 29400)
    assert parse_endpoint("[fd00::1]:5") == ("fd00::1", 5)
    for bad in ("head", ":29400", "head:0", "head:x", "a b:1"):
        with pytest.raises(ValueError, match=r"host:port|port"):
            parse_endpoint(bad)


def test_passthrough_takes_only_the_allowed_variables() -> None:
    environ = {"NCCL_IB_HCA": "mlx5_0", "NCCL_SOCKET_IFNAME": "ib0", "HOME": "/root", "X": "1"}
    assert passthrough_env(environ, ("NCCL_*",)) == {
        "NCCL_IB_HCA": "mlx5_0",
        "NCCL_SOCKET_IFNAME": "ib0",
    }
    assert passthrough_env(environ, ("NCCL_IB_HCA", "X")) == {"NCCL_IB_HCA": "mlx5_0", "X": "1"}
    assert passthrough_env(environ, ()) == {}


def test_srun_command_inside_an_allocation_and_requesting_one() -> None:
    inside = srun_command("srun", SrunSpec(4, "1234", "geofed-x"), ["python", "-m", "m"])
    assert inside[:9] == [
        "srun",
        "--nodes=4",
        "--ntasks=4",
        "--ntasks-per-node=1",
        "--job-name=geofed-x",
        "--export=ALL",
        "--kill-on-bad-exit=0",
        "--unbuffered",
        "--jobid=1234",
    ]
    assert inside[-3:] == ["python", "-m", "m"]
    spec = SrunSpec(
        2, None, "g", partition="gpu", time_limit="1-00:00:00", extra_args=("--gpus-per-node=8",)
    )
    own = srun_command("srun", spec, ["cmd"])
    assert "--partition=gpu" in own
    assert "--time=1-00:00:00" in own
    assert not any(arg.startswith("--jobid") for arg in own)
    assert own[-2:] == ["--gpus-per-node=8", "cmd"]


def test_a_slurm_step_leaves_out_the_nodes_excluded(tmp_path: Path) -> None:
    launcher = SlurmLauncher(tmp_path, cfg(nnodes=3), SlurmOptions(), environ={})
    assert "--exclude" not in " ".join(launcher.command(port=1, launch_id="a"))
    launcher.exclude(frozenset({"node-c", "node-b"}))
    command = launcher.command(port=1, launch_id="a")
    assert "--exclude=node-b,node-c" in command
    assert "--nodes=1" in command
    assert "--nnodes=1" in command, "the elastic launchers expect one node"
    assert launcher.world_size == launcher.ranks.count
    with pytest.raises(LauncherConfigError, match="cannot leave out 3 of the group's 3 nodes"):
        launcher.exclude(frozenset({"a", "b", "c"}))
    launcher.exclude(frozenset())
    assert "--nodes=3" in launcher.command(port=1, launch_id="a")


def test_slurm_launcher_command_runs_one_elastic_launcher_per_node(tmp_path: Path) -> None:
    config = cfg(nnodes=2)
    launcher = SlurmLauncher(
        tmp_path,
        config,
        SlurmOptions(rdzv_port=29444, extra_args=("--account=ml",)),
        environ={"SLURM_JOB_ID": "77"},
    )
    command = launcher.command(port=1, launch_id="abc")
    assert command[0] == "srun"
    assert "--jobid=77" in command
    assert "--nodes=2" in command
    node = command.index("regional_agent.launch.slurm_node")
    assert command[node - 2 : node + 4] == [
        sys.executable,
        "-m",
        "regional_agent.launch.slurm_node",
        "--scontrol",
        "scontrol",
        "--",
    ]
    elastic = command[node + 4 :]
    args = parsed(elastic)
    assert (args.nnodes, args.nproc_per_node, args.rdzv_id) == ("2", "2", "abc")
    assert args.rdzv_endpoint == f"{HEAD_PLACEHOLDER}:29444"
    assert launcher.world_size == 4
    assert launcher.environment("abc")[HEAD_SLURM_TASK_ENV] == "0"
    # Each task fills in the head and whether it hosts the rendezvous.
    head = parsed(node_argv(elastic, "10.1.0.1", {HEAD_SLURM_TASK_ENV: "0", "SLURM_PROCID": "0"}))
    other = parsed(node_argv(elastic, "10.1.0.1", {HEAD_SLURM_TASK_ENV: "0", "SLURM_PROCID": "1"}))
    assert (head.rdzv_endpoint, head.rdzv_conf) == ("10.1.0.1:29444", "is_host=1")
    assert (other.rdzv_endpoint, other.rdzv_conf) == ("10.1.0.1:29444", "is_host=0")
    with pytest.raises(LauncherConfigError, match="sets the rendezvous itself"):
        SlurmLauncher(
            tmp_path,
            cfg(nnodes=2, rdzv_endpoint="h:1", rdzv_id="x"),
            SlurmOptions(),
        )


def test_scontrol_output_parsing() -> None:
    assert first_host("\ngpu-017\ngpu-018\n") == "gpu-017"
    shown = "NodeName=gpu-017 Arch=x86_64 NodeAddr=10.2.0.17 NodeHostName=gpu-017 Port=0"
    assert node_addr(shown, "gpu-017") == "10.2.0.17"
    assert node_addr("NodeName=x", "x") == "x"
    with pytest.raises(ValueError, match="no host"):
        first_host("")


def test_workers_config_selects_and_shapes_the_launcher(
    tmp_path: Path, federation: Federation, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = (
        "workers:\n  launcher: slurm\n  nnodes: 2\n  nproc_per_node: 1\n  backend: gloo\n"
        "  env: {NCCL_IB_HCA: mlx5_1}\n  env_passthrough: [NCCL_*, GLOO_SOCKET_IFNAME]\n"
        "  slurm: {rdzv_port: 29555, partition: gpu, extra_args: [--gpus-per-node=8]}\n"
    )
    config = load_config(write(tmp_path, federation, extra=extra))
    workers = config.workers
    assert (workers.count, workers.nnodes, workers.launcher) == (1, 2, "slurm")
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_0")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    launcher = make_launcher(workers, tmp_path / "w", environ={})
    assert isinstance(launcher, SlurmLauncher)
    env = launcher.environment("abc")
    # The config's own value wins over the agent's environment.
    assert (env["NCCL_IB_HCA"], env["NCCL_SOCKET_IFNAME"]) == ("mlx5_1", "ib0")
    assert env["GLOO_SOCKET_IFNAME"] == "eth1"
    command = launcher.command(0, "abc")
    assert "--partition=gpu" in command
    assert "--gpus-per-node=8" in command
    assert parsed(command).rdzv_endpoint == f"{HEAD_PLACEHOLDER}:29555"
    local = load_config(write(tmp_path, federation)).workers
    assert isinstance(make_launcher(local, tmp_path / "w", environ={}), LocalElasticLauncher)
    assert local.nnodes == 1
    # gloo's interface choice reaches every node's workers by default, as NCCL's does.
    assert local.env_passthrough == ("NCCL_*", "GLOO_SOCKET_IFNAME")
    passed = passthrough_env({"GLOO_SOCKET_IFNAME": "eth1", "HOME": "/root"}, local.env_passthrough)
    assert passed == {"GLOO_SOCKET_IFNAME": "eth1"}


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            "workers: {nnodes: 2}\n",
            "agent.yaml:11: workers: nnodes > 1 with the local launcher needs rdzv_endpoint",
        ),
        ("workers: {nnodes: 0}\n", "agent.yaml:11: workers.nnodes: Input should be greater"),
        ("workers: {launcher: k8s}\n", "agent.yaml:11: workers.launcher: Input should be"),
        (
            "workers: {rdzv_endpoint: 'head'}\n",
            "agent.yaml:11: workers.rdzv_endpoint: 'head' is not host:port",
        ),
        (
            "workers: {env_passthrough: ['NCCL-*']}\n",
            "agent.yaml:11: workers.env_passthrough: 'NCCL-*' is not a variable name",
        ),
        (
            "workers: {count: 2, nproc_per_node: 2}\n",
            "agent.yaml:11: workers: give count or nproc_per_node, not both",
        ),
        (
            "workers: {nproc_per_node: 0}\n",
            "agent.yaml:11: workers.count: must be an integer >= 1",
        ),
        (
            "workers: {launcher: slurm, nnodes: 2, rdzv_endpoint: 'h:1'}\n",
            "agent.yaml:11: workers: rdzv_endpoint and rdzv_id are for the local launcher",
        ),
        (
            "workers:\n  slurm: {rdzv_port: 0}\n",
            "agent.yaml:12: workers.slurm.rdzv_port: Input should be greater",
        ),
        (
            "workers:\n  slurm: {extra_args: [gpus]}\n",
            "agent.yaml:12: workers.slurm.extra_args: 'gpus' is not an srun option",
        ),
        (
            "workers:\n  stragglers: {exclude: true}\n",
            "agent.yaml:11: workers: stragglers.exclude needs the slurm launcher",
        ),
        (
            "workers:\n  launcher: slurm\n  stragglers: {exclude: true, min_nodes: 3}\n",
            "agent.yaml:11: workers: stragglers.min_nodes (3) exceeds nnodes (1)",
        ),
    ],
)
def test_bad_workers_settings_name_file_line_and_key(
    tmp_path: Path, federation: Federation, extra: str, expected: str
) -> None:
    found = problems(write(tmp_path, federation, extra=extra))
    assert any(expected in p for p in found), found


def test_multi_node_local_settings_reach_the_launcher() -> None:
    workers = WorkersConfig(
        nnodes=2, rdzv_endpoint="10.0.0.5:29500", rdzv_id="eu", local_addr="10.0.0.5"
    )
    config = workers.launcher_config()
    assert (config.nnodes, config.rdzv_endpoint, config.rdzv_id) == (2, "10.0.0.5:29500", "eu")
    assert (config.local_addr, config.head) == ("10.0.0.5", True)
