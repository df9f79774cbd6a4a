"""Which datasets a round reads in a region, the refusal of a job naming one the region does
not train on, and the locations' way through the announcement and the instruction."""

from __future__ import annotations

import json
from typing import Any

import pytest

from geofed.control import RoundAnnouncement, decode, encode
from geofed.data import DataError, DatasetLocation
from regional_agent.handoff.errors import InvalidHandoffData
from regional_agent.handoff.messages import RoundInstruction
from regional_agent.rounds.datasets import round_datasets
from regional_agent.worker.inner_loop import data_shard
from tests.support.agent_schedule import REGION, announce

CHATS = DatasetLocation(path="/data/chats", format="jsonl", cache_dir="/state/datasets/chats")
BOOKS = DatasetLocation(path="/data/books/*.bin", format="tokens", dtype="uint32")
HELD = ("eu-books", "eu-chats", "eu-proceedings")
LOCATED = {"eu-chats": CHATS, "eu-books": BOOKS}


def test_a_round_reads_the_datasets_the_job_names_for_the_region() -> None:
    named = announce(datasets={REGION: ("eu-chats", "eu-proceedings"), "us-east": ("us-web",)})
    found = round_datasets(named, REGION, HELD, LOCATED)
    # eu-proceedings has no files here: a task with data of its own needs none.
    assert found.refusal is None
    assert dict(found.locations) == {"eu-chats": CHATS}


def test_a_coordinator_that_names_no_datasets_gets_every_located_one() -> None:
    found = round_datasets(announce(), REGION, HELD, LOCATED)
    assert found.refusal is None
    assert list(found.locations) == ["eu-books", "eu-chats"]


def test_a_job_naming_a_dataset_the_region_does_not_train_on_is_refused() -> None:
    named = announce(datasets={REGION: ("eu-chats", "eu-secret", "eu-other")})
    found = round_datasets(named, REGION, HELD, LOCATED)
    assert found.locations == {}
    assert found.refusal == (
        f"job llm trains region {REGION} on eu-other, eu-secret, which this agent does not "
        "train on (its datasets: eu-books, eu-chats, eu-proceedings)"
    )


def _instruction(**fields: Any) -> RoundInstruction:
    """Round 1 of job llm in this region, with ``fields``."""
    return RoundInstruction(
        job="llm",
        round=1,
        base_params="/state/base.pt",
        inner_steps=5,
        task="tests.support.tiny_task:TinyTask",
        task_options={},
        seed=0,
        region=REGION,
        region_index=0,
        num_regions=2,
        **fields,
    )


def test_the_datasets_travel_in_the_announcement_and_reach_the_workers_shard() -> None:
    named = announce(datasets={REGION: ("eu-chats",)})
    assert decode(encode(named), RoundAnnouncement).datasets == {REGION: ("eu-chats",)}
    instruction = _instruction(datasets=LOCATED)
    again = RoundInstruction.from_json(instruction.to_json())
    assert again == instruction
    assert dict(data_shard(again, 1, 2).datasets) == LOCATED
    # An agent that predates locations writes none: the workers get none.
    body = json.loads(instruction.to_json())
    del body["datasets"]
    assert RoundInstruction.from_json(json.dumps(body).encode()).datasets == {}


def test_the_datasets_named_without_files_reach_the_workers_shard() -> None:
    named = announce(datasets={REGION: ("eu-chats", "eu-proceedings")})
    found = round_datasets(named, REGION, HELD, LOCATED)
    assert found.without_files == ("eu-proceedings",)
    assert round_datasets(announce(), REGION, HELD, LOCATED).without_files == ("eu-proceedings",)
    instruction = _instruction(
        datasets=dict(found.locations), datasets_without_files=found.without_files
    )
    again = RoundInstruction.from_json(instruction.to_json())
    assert again == instruction
    shard = data_shard(again, 0, 1)
    assert shard.datasets_without_files == ("eu-proceedings",)
    with pytest.raises(DataError, match="dataset eu-proceedings has no files in region"):
        shard.located()
    assert shard.located(["eu-chats"]) == {"eu-chats": CHATS}
    # An agent that predates the field writes none: nothing is missing.
    body = json.loads(instruction.to_json())
    del body["datasets_without_files"]
    assert RoundInstruction.from_json(json.dumps(body).encode()).datasets_without_files == ()
    with pytest.raises(InvalidHandoffData, match=r"invalid dataset '\.\./x'"):
        RoundInstruction.from_json(
            json.dumps({**body, "datasets_without_files": ["../x"]}).encode()
        )
