"""Where the demo's regions train on 0, 1, 2, 3 or 8 GPUs, and what their agent configs say."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from geofed_cli.demo.configs import DemoConfigs, find_examples, write_demo_configs
from geofed_cli.demo.federation import DemoFederation, create_demo_federation
from geofed_cli.demo.placement import Placement, PlacementRefused, RegionPlacement, place
from regional_agent.config import load_config

REGIONS = ("eu-west", "us-east", "ap-south", "sa-east")


def gpus(n: int) -> tuple[str, ...]:
    return tuple(str(index) for index in range(n))


def layout(placement: Placement) -> list[tuple[tuple[str, ...], str, int]]:
    return [(share.devices, share.backend, share.ranks) for share in placement.regions]


@pytest.mark.parametrize("regions", [1, 2, 3, 4])
def test_no_gpu_runs_two_gloo_ranks_per_region(regions: int) -> None:
    placement = place((), REGIONS[:regions])
    assert layout(placement) == [((), "gloo", 2)] * regions
    assert placement.reason == "no GPU visible: 2 gloo ranks per region on the CPU"
    assert placement.describe() == placement.reason


@pytest.mark.parametrize("regions", [1, 2, 3, 4])
def test_one_gpu_is_shared_one_nccl_rank_each(regions: int) -> None:
    placement = place(gpus(1), REGIONS[:regions])
    assert layout(placement) == [(("0",), "nccl", 1)] * regions


@pytest.mark.parametrize(
    ("count", "regions", "devices"),
    [
        (2, 1, [("0", "1")]),
        (2, 2, [("0",), ("1",)]),
        (2, 3, [("0",), ("1",), ("0",)]),
        (2, 4, [("0",), ("1",), ("0",), ("1",)]),
        (3, 1, [("0", "1", "2")]),
        (3, 2, [("0", "1"), ("2",)]),
        (3, 3, [("0",), ("1",), ("2",)]),
        (3, 4, [("0",), ("1",), ("2",), ("0",)]),
        (8, 1, [gpus(8)]),
        (8, 2, [("0", "1", "2", "3"), ("4", "5", "6", "7")]),
        (8, 3, [("0", "1", "2"), ("3", "4", "5"), ("6", "7")]),
        (8, 4, [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")]),
    ],
)
def test_gpus_are_split_or_shared(count: int, regions: int, devices: list[tuple[str, ...]]) -> None:
    placement = place(gpus(count), REGIONS[:regions])
    assert [share.region for share in placement.regions] == list(REGIONS[:regions])
    # One nccl rank per GPU of the share: what each agent's count: auto decides.
    assert layout(placement) == [(share, "nccl", len(share)) for share in devices]


@pytest.mark.parametrize(
    ("count", "regions", "reason", "agents"),
    [
        (
            0,
            3,
            "no GPU visible: 2 gloo ranks per region on the CPU",
            "3 regional agents, 2 local workers each (gloo)",
        ),
        (
            1,
            3,
            "1 GPU for 3 regions: the regions share it, one nccl rank each "
            "(eu-west GPU 0; us-east GPU 0; ap-south GPU 0)",
            "3 regional agents, 1 local worker each (nccl)",
        ),
        (
            2,
            3,
            "2 GPUs for 3 regions: the regions share them in turn, one nccl rank each "
            "(eu-west GPU 0; us-east GPU 1; ap-south GPU 0)",
            "3 regional agents, 1 local worker each (nccl)",
        ),
        (
            8,
            3,
            "8 GPUs for 3 regions: split 3+3+2, one nccl rank per GPU "
            "(eu-west GPU 0,1,2; us-east GPU 3,4,5; ap-south GPU 6,7)",
            "3 regional agents, 3/3/2 local workers (nccl)",
        ),
        (
            8,
            1,
            "8 GPUs for 1 region: one nccl rank per GPU (eu-west GPU 0,1,2,3,4,5,6,7)",
            "1 regional agent, 8 local workers each (nccl)",
        ),
    ],
)
def test_the_placement_says_what_it_chose(
    count: int, regions: int, reason: str, agents: str
) -> None:
    placement = place(gpus(count), REGIONS[:regions])
    assert placement.describe() == reason
    assert placement.agents_line() == agents


def test_device_names_are_kept() -> None:
    placement = place(("2", "5"), ("eu-west", "us-east"))
    assert placement.of("us-east") == RegionPlacement("us-east", ("5",), "nccl", 1)


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> DemoFederation:
    root = tmp_path_factory.mktemp("pki")
    return create_demo_federation(root, "demo", ["eu-west", "us-east", "ap-south"])


def demo_configs(
    work: Path, federation: DemoFederation, regions: list[str], placement: Placement
) -> DemoConfigs:
    """The demo's configs of a 2-round job for ``regions`` placed as ``placement`` says."""
    return write_demo_configs(
        examples=find_examples(),
        work=work,
        federation=federation,
        regions=regions,
        http_port=8443,
        mqtt_port=1883,
        rounds=2,
        inner_steps=2,
        placement=placement,
    )


@pytest.mark.parametrize("count", [0, 1, 8])
def test_each_agent_config_carries_its_share(
    tmp_path: Path, federation: DemoFederation, count: int
) -> None:
    regions = ["eu-west", "us-east", "ap-south"]
    placement = place(gpus(count), regions)
    configs = demo_configs(tmp_path, federation, regions, placement)
    for share in placement.regions:
        written = yaml.safe_load(configs.agents[share.region].read_text())["workers"]
        assert (written["count"], written["backend"]) == ("auto", share.backend)
        workers = load_config(configs.agents[share.region]).workers
        assert workers.env.get("CUDA_VISIBLE_DEVICES") == (
            ",".join(share.devices) if share.devices else None
        )


def test_a_cpu_run_takes_the_worker_count_asked_and_writes_it(
    tmp_path: Path, federation: DemoFederation
) -> None:
    regions = ["eu-west", "us-east"]
    placement = place((), regions, cpu_ranks=1)
    assert layout(placement) == [((), "gloo", 1)] * 2
    assert placement.reason == "no GPU visible: 1 gloo rank per region on the CPU"
    assert placement.agents_line() == "2 regional agents, 1 local worker each (gloo)"
    configs = demo_configs(tmp_path, federation, regions, placement)
    for region in regions:
        assert load_config(configs.agents[region]).workers.count == 1


def test_a_worker_count_is_refused_with_a_gpu() -> None:
    with pytest.raises(PlacementRefused, match=r"1 GPU visible: .* a worker count is for CPU runs"):
        place(gpus(1), ("eu-west",), cpu_ranks=1)
