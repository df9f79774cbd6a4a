"""A region's data is fixed by the job's assignment, never by who takes part in a round:
quarantining one region changes no other region's batches."""

from __future__ import annotations

from itertools import islice

import torch

from geofed.control import RoundAnnouncement
from regional_agent.handoff.messages import RoundInstruction
from regional_agent.worker.inner_loop import data_shard
from tests.support.agent_schedule import announce
from tests.support.tiny_task import SPEC, TinyTask

REGIONS = ("ap-south", "eu-west", "us-east")
WORLD = 2


def instruction(announcement: RoundAnnouncement, region: str) -> RoundInstruction:
    """What the agent of ``region`` asks its workers to train (as the pipeline builds it)."""
    region_index, num_regions = announcement.data_shard(region)
    return RoundInstruction(
        job=announcement.job,
        round=announcement.round,
        base_params="/state/base.pt",
        inner_steps=announcement.inner_steps,
        task=SPEC,
        task_options={},
        seed=announcement.seed,
        region=region,
        region_index=region_index,
        num_regions=num_regions,
    )


def batches(announcement: RoundAnnouncement, region: str, start: int = 0) -> list[torch.Tensor]:
    """Every rank's first batches of ``region`` in the round ``announcement`` opens."""
    task = TinyTask()
    inputs = []
    for rank in range(WORLD):
        shard = data_shard(instruction(announcement, region), rank, WORLD)
        inputs += [batch.inputs for batch in islice(task.batches(shard, start), 4)]
    return inputs


def same(left: list[torch.Tensor], right: list[torch.Tensor]) -> bool:
    return len(left) == len(right) and all(
        torch.equal(a, b) for a, b in zip(left, right, strict=False)
    )


def test_quarantining_a_region_changes_no_other_regions_batches() -> None:
    everyone = announce("llm", 2, regions=REGIONS, participants=REGIONS)
    for quarantined in REGIONS:
        others = tuple(r for r in REGIONS if r != quarantined)
        without = announce("llm", 2, regions=REGIONS, participants=others)
        for region in others:
            assert same(batches(without, region), batches(everyone, region)), (quarantined, region)
            assert same(batches(without, region, 40), batches(everyone, region, 40))


def test_the_regions_of_a_job_read_different_data() -> None:
    everyone = announce("llm", 2, regions=REGIONS, participants=REGIONS)
    shards = {r: data_shard(instruction(everyone, r), 0, WORLD) for r in REGIONS}
    assert sorted((s.region_index, s.num_regions) for s in shards.values()) == [
        (0, 3),
        (1, 3),
        (2, 3),
    ]
    read = {r: batches(everyone, r) for r in REGIONS}
    assert not same(read["ap-south"], read["eu-west"])
    assert not same(read["eu-west"], read["us-east"])
    # Left out of a round, a region's place among the job's regions is not given away:
    # were it the participants' index, eu-west would read ap-south's data here.
    alone = announce("llm", 2, regions=REGIONS, participants=("eu-west",))
    assert not same(batches(alone, "eu-west"), read["ap-south"])
