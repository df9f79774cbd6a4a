"""How many ranks a worker group runs: ``count: auto`` and explicit counts, per backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from regional_agent.handoff.settings import LauncherConfigError
from regional_agent.launch.launcher import LocalElasticLauncher, LocalLauncherConfig
from regional_agent.launch.ranks import (
    RankChoice,
    RankCountError,
    choose_ranks,
    parse_visible_devices,
    visible_gpu_count,
)


@pytest.mark.parametrize(
    ("requested", "backend", "gpus", "expected"),
    [
        ("auto", "gloo", 0, RankChoice(2, "count auto: 2 gloo ranks")),
        ("auto", "gloo", 8, RankChoice(2, "count auto: 2 gloo ranks")),
        (3, "gloo", 0, RankChoice(3, "count 3: gloo ranks as configured")),
        ("auto", "nccl", 1, RankChoice(1, "count auto: one nccl rank per visible GPU (1)")),
        ("auto", "nccl", 8, RankChoice(8, "count auto: one nccl rank per visible GPU (8)")),
        (2, "nccl", 4, RankChoice(2, "count 2: nccl ranks on 4 visible GPUs")),
    ],
)
def test_choose_ranks(requested: int | str, backend: str, gpus: int, expected: RankChoice) -> None:
    assert choose_ranks(requested, backend, gpus) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("requested", "gpus", "message"),
    [
        ("auto", 0, "backend nccl needs a GPU, but none is visible"),
        (1, 0, "nproc_per_node 1 exceeds the 0 visible GPUs: NCCL refuses two ranks on one GPU"),
        (2, 1, "nproc_per_node 2 exceeds the 1 visible GPUs: NCCL refuses two ranks on one GPU"),
    ],
)
def test_nccl_refuses_what_the_gpus_cannot_run(
    requested: int | str, gpus: int, message: str
) -> None:
    with pytest.raises(RankCountError, match=message):
        choose_ranks(requested, "nccl", gpus)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "devices"),
    [
        ("", ()),
        ("-1", ()),
        ("0", ("0",)),
        ("2, 3", ("2", "3")),
        ("1,-1,2", ("1",)),
        ("GPU-8e1f,MIG-2a", ("GPU-8e1f", "MIG-2a")),
    ],
)
def test_parse_visible_devices(value: str, devices: tuple[str, ...]) -> None:
    assert parse_visible_devices(value) == devices


@pytest.mark.parametrize(
    ("workers_env", "own_env", "device_count", "expected"),
    [
        ({}, {}, 4, 4),
        ({"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "1"}, 1, 1),
        ({"CUDA_VISIBLE_DEVICES": "2,3"}, {}, 4, 2),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, {}, 2, 2),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, {"CUDA_VISIBLE_DEVICES": "5"}, 1, 3),
        ({"CUDA_VISIBLE_DEVICES": ""}, {}, 4, 0),
    ],
)
def test_visible_gpu_count(
    workers_env: dict[str, str], own_env: dict[str, str], device_count: int, expected: int
) -> None:
    assert visible_gpu_count(workers_env, own_env, device_count) == expected


def test_auto_runs_two_gloo_ranks(tmp_path: Path) -> None:
    launcher = LocalElasticLauncher(tmp_path, LocalLauncherConfig(backend="gloo"), environ={})
    assert launcher.world_size == 2
    assert launcher.ranks.reason == "count auto: 2 gloo ranks"


def test_auto_on_nccl_counts_the_gpus_of_the_workers_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The machine's GPUs are the edge: a fake machine that reports four.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    whole = LocalElasticLauncher(
        tmp_path, LocalLauncherConfig(backend="nccl"), environ={}, gpu_count=_four_gpus
    )
    assert whole.world_size == 4
    share = LocalLauncherConfig(backend="nccl", env={"CUDA_VISIBLE_DEVICES": "2,3"})
    on_share = LocalElasticLauncher(tmp_path, share, environ={}, gpu_count=_four_gpus)
    assert on_share.world_size == 2
    assert "--nproc-per-node=2" in on_share.command(port=29500, launch_id="abc")


@pytest.mark.parametrize(
    ("count", "message"),
    [(0, "nproc_per_node must be an integer >= 1 or 'auto'"), ("all", "or 'auto', got 'all'")],
)
def test_a_bad_count_is_refused(tmp_path: Path, count: object, message: str) -> None:
    with pytest.raises(LauncherConfigError, match=message):
        LocalLauncherConfig(nproc_per_node=count)  # type: ignore[arg-type]


def _four_gpus() -> int:
    """Fake GPU count of a four-GPU machine (the hardware is the outer edge)."""
    return 4


def _no_gpu() -> int:
    """Fake GPU count of a machine without a GPU."""
    return 0


def test_nccl_without_a_gpu_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LauncherConfigError, match="backend nccl needs a GPU"):
        LocalElasticLauncher(
            tmp_path, LocalLauncherConfig(backend="nccl"), environ={}, gpu_count=_no_gpu
        )
