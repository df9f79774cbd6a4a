"""Delayed rounds in a real worker group (2 gloo ranks under torch.distributed.run).

The agent's side is played through the hand-off directory: round 0 serially, then round
1 as a speculative instruction (``base_pending``) whose θ comes later through the
base-ready marker. With θ_1 equal to the parameters the group ended round 0 with, the
correction y <- θ_1 + (y - S) changes nothing, so the delayed round must train exactly
what a serial round 1 from that θ trains (same optimizer state, data cursor, schedule),
under DDP and FSDP, wherever the fold lands. A cancelled speculative round leaves no
trace: the round trained serially afterwards matches the reference too.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from coordinator.publication.evaluation_process import evaluate_params
from geofed.params import parameters_vector_hash
from geofed.training_config import TrainingConfig
from regional_agent.handoff.messages import BaseReady, RoundResult
from regional_agent.handoff.overlap import next_instruction
from regional_agent.launch.worker_group import RoundFailed
from tests.support.tiny_task import TinyTask
from tests.support.worker_group import DelayedRegion, instruction, save_state, wait_for_progress

pytestmark = pytest.mark.integration
on_module_loop = pytest.mark.asyncio(loop_scope="module")

STEPS = 60  # long enough that θ can come while the round trains


class Group(DelayedRegion):
    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, STEPS)

    async def serial_pair(self, job: str, training: TrainingConfig) -> RoundResult:
        """Round 0 from θ0, round 1 serially from round 0's result; round 1's result."""
        first = await self.group.run_round(self.first(job, training), 60)
        base1 = save_state(self.workdir / f"{job}-1.pt", first.params)
        second = instruction(job, 1, base1, inner_steps=STEPS, training=training, overlap="delayed")
        return await self.group.run_round(second, 60)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def region(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Group]:
    state = Group(tmp_path_factory.mktemp("delayed"))
    await state.group.start()
    yield state
    await state.group.stop()


def assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=1e-5, atol=1e-6)


@on_module_loop
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
async def test_a_delayed_round_trains_what_a_serial_round_from_the_same_theta_trains(
    region: Group, parallelism: str
) -> None:
    training = TrainingConfig(parallelism=parallelism)  # type: ignore[arg-type]
    reference = await region.serial_pair(f"serial-{parallelism}", training)

    job = f"delayed-{parallelism}"
    first = await region.group.run_round(region.first(job, training), 60)
    theta1 = region.workdir / f"{job}-1.pt"
    speculative = next_instruction(region.first(job, training), str(theta1))
    await asyncio.to_thread(region.handoff.write_instruction, speculative)
    # θ_1 comes while the round trains (not there when it started).
    await wait_for_progress(region.handoff, job, 1, 3)
    save_state(theta1, first.params)
    ready = BaseReady(job, 1, str(theta1), parameters_vector_hash(first.params), True)
    region.handoff.write_base_ready(ready)
    result = await region.group.collect_round(job, 1, 60)

    summary = result.summary
    assert summary.base_folded_at_step is not None
    assert 1 <= summary.base_folded_at_step <= STEPS
    assert summary.base_params_hash == ready.base_hash
    assert summary.base_wait_seconds is not None
    assert (summary.cursor, summary.tokens) == (reference.summary.cursor, reference.summary.tokens)
    assert_close(result.params, reference.params)
    # θ_1 was evaluated when it was folded in, as the serial round evaluates its base.
    expected = evaluate_params(TinyTask(), 1, first.params)
    assert summary.base_eval is not None
    for name, value in expected.items():
        assert math.isclose(summary.base_eval[name], value, rel_tol=1e-5), name


@on_module_loop
async def test_a_cancelled_delayed_round_leaves_no_trace(region: Group) -> None:
    training = TrainingConfig()
    reference = region.handoff.read_completed("serial-ddp", 1)
    assert reference is not None

    job = "cancelled"
    first = await region.group.run_round(region.first(job, training), 60)
    theta1 = save_state(region.workdir / f"{job}-1.pt", first.params)
    speculative = next_instruction(region.first(job, training), str(theta1))
    await asyncio.to_thread(region.handoff.write_instruction, speculative)
    await wait_for_progress(region.handoff, job, 1, 3)
    region.handoff.request_cancel(job, 1)
    with pytest.raises(RoundFailed, match="cancelled"):
        await region.group.collect_round(job, 1, 60)
    region.handoff.clear_cancel(job, 1)

    # The round trained serially from θ_1 resumes from round 0's regional checkpoint.
    serial = instruction(job, 1, theta1, inner_steps=STEPS, training=training, overlap="delayed")
    result = await region.group.run_round(serial, 60)
    assert result.summary.base_folded_at_step is None
    assert result.summary.cursor == reference.summary.cursor
    assert_close(result.params, reference.params)
