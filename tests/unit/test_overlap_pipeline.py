"""The agent's side of delayed rounds, over a real hand-off directory (no workers: the
test answers for them)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest

from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.messages import RoundInstruction, RoundResult, RoundSummary
from regional_agent.handoff.overlap import next_instruction
from regional_agent.rounds.overlap_pipeline import DelayedRounds
from tests.support.agent_schedule import announce

TRAINED = RoundInstruction(
    job="job-a",
    round=3,
    base_params="/state/params/round-3.pt",
    inner_steps=5,
    task="tests.support.tiny_task:TinyTask",
    task_options={},
    seed=1,
    region="eu-west",
    region_index=0,
    num_regions=2,
    overlap="delayed",
)
PROMISED = Path("/state/params/round-4.pt")
RESULT = RoundResult(
    RoundSummary(
        job="job-a",
        round=4,
        steps=5,
        tokens=10,
        mean_loss=1.0,
        cursor=25,
        base_params_hash="h" * 64,
        params_hash="p" * 64,
        world_size=1,
        train_seconds=1.0,
        train_started_at=1.0,
        base_folded_at_step=2,
        base_wait_seconds=0.0,
    ),
    {},
)
WANTED = replace(TRAINED, round=4, base_params=str(PROMISED), evaluate_base=True)


class Workers:
    """The worker group's hand-off directory; collect_round records what it was asked."""

    def __init__(self, root: Path) -> None:
        self.handoff = HandoffDir(root)
        self.collected: list[tuple[str, int]] = []

    async def collect_round(self, job: str, round_: int, timeout_s: float) -> RoundResult:
        self.collected.append((job, round_))
        return RESULT


def delayed(tmp_path: Path) -> tuple[DelayedRounds, Workers]:
    workers = Workers(tmp_path)
    return DelayedRounds(cast(Any, workers), "eu-west", 5.0), workers


async def answer_cancel(handoff: HandoffDir, job: str, round_: int) -> None:
    """What the workers do with a cancel: an error marker for the round."""
    for _ in range(500):
        if handoff.cancel_requested(job, round_):
            break
        await asyncio.sleep(0.01)
    handoff.write_error(job, round_, "the delayed round was cancelled by the agent")


async def test_a_delayed_job_starts_the_next_round_ahead_unless_it_is_the_last(
    tmp_path: Path,
) -> None:
    rounds, workers = delayed(tmp_path)
    await rounds.speculate(announce(round_=3, overlap="delayed", total_rounds=5), TRAINED, PROMISED)
    spec = workers.handoff.read_instruction("job-a", 4)
    assert spec.base_pending
    assert spec.base_params == str(PROMISED)
    assert workers.handoff.pending_instruction() == ("job-a", 4)
    last = replace(TRAINED, round=4)
    await rounds.speculate(announce(round_=4, overlap="delayed", total_rounds=5), last, PROMISED)
    assert not workers.handoff.instruction_path("job-a", 5).exists()
    serial = replace(TRAINED, round=1, overlap="none")
    await rounds.speculate(announce(round_=1, total_rounds=5), serial, PROMISED)
    assert not workers.handoff.instruction_path("job-a", 2).exists()


async def test_a_usable_speculative_round_gets_theta_and_its_result_is_collected(
    tmp_path: Path,
) -> None:
    rounds, workers = delayed(tmp_path)
    workers.handoff.write_instruction(next_instruction(TRAINED, str(PROMISED)))
    assert await rounds.train(WANTED, "h" * 64) is RESULT
    ready = workers.handoff.read_base_ready("job-a", 4)
    assert ready is not None
    assert (ready.base_params, ready.base_hash, ready.evaluate_base) == (
        str(PROMISED),
        "h" * 64,
        True,
    )
    assert workers.collected == [("job-a", 4)]


async def test_an_unusable_speculative_round_is_cancelled_and_trained_serially(
    tmp_path: Path,
) -> None:
    rounds, workers = delayed(tmp_path)
    workers.handoff.write_instruction(next_instruction(TRAINED, str(PROMISED)))
    answering = asyncio.create_task(answer_cancel(workers.handoff, "job-a", 4))
    # Another region joined: this region's data shard changed.
    assert await rounds.train(replace(WANTED, num_regions=3), "h" * 64) is None
    await answering
    assert workers.collected == []
    assert workers.handoff.read_base_ready("job-a", 4) is None
    assert not workers.handoff.cancel_requested("job-a", 4)


@pytest.mark.parametrize(
    ("fields", "cancelled"),
    [
        ({"round_": 4, "state": "open"}, False),
        ({"round_": 3, "state": "closed"}, False),
        ({"round_": 4, "state": "paused"}, True),
        ({"round_": 4, "state": "open", "participants": ["us-east"]}, True),
        ({"round_": 5, "state": "open"}, True),
    ],
)
async def test_announcements_that_end_the_speculative_round_ask_for_its_cancel(
    tmp_path: Path, fields: dict[str, Any], cancelled: bool
) -> None:
    rounds, workers = delayed(tmp_path)
    workers.handoff.write_instruction(next_instruction(TRAINED, str(PROMISED)))
    participants = fields.pop("participants", ["eu-west", "us-east"])
    announcement = announce(job="job-a", participants=participants, overlap="delayed", **fields)
    await rounds.announced(announcement)
    assert workers.handoff.cancel_requested("job-a", 4) == cancelled


async def test_settling_keeps_the_next_round_only_while_the_delta_is_to_be_delivered(
    tmp_path: Path,
) -> None:
    rounds, workers = delayed(tmp_path)
    workers.handoff.write_instruction(next_instruction(TRAINED, str(PROMISED)))
    await rounds.settle(announce(job="job-a", round_=3), resync=False, spooled=True)
    await rounds.settle(announce(job="job-a", round_=4), resync=False, spooled=False)
    assert not workers.handoff.cancel_requested("job-a", 4)
    # Another job's round is about to run: the speculative round must go first.
    answering = asyncio.create_task(answer_cancel(workers.handoff, "job-a", 4))
    await rounds.settle(announce(job="job-b", round_=0), resync=False, spooled=False)
    await answering
    assert workers.handoff.read_error("job-a", 4) is not None
    assert workers.handoff.pending_instruction() is None
