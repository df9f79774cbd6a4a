"""Eager delayed rounds (``overlap_start: eager``) in a real worker group (2 gloo ranks
under torch.distributed.run).

The agent's side is played through the hand-off directory: round 0 serially, then round
1 as an eager speculative instruction whose start S comes later through the start marker,
and θ_1 through the base-ready marker. With θ_1 = S the fold changes nothing, so the round
must train exactly what a serial round 1 from θ = S trains: proof that every rank started
from S (its shard under FSDP). A marker without S keeps the local start; an S that does
not match its hash, or a cancel while the ranks wait for S, ends the round.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from geofed.params import parameters_vector_hash
from geofed.training_config import TrainingConfig
from regional_agent.handoff.messages import BaseReady, RoundInstruction, RoundResult
from regional_agent.handoff.overlap import next_instruction
from regional_agent.launch.worker_group import RoundFailed
from tests.support.worker_group import DelayedRegion, instruction, save_state

pytestmark = pytest.mark.integration
on_module_loop = pytest.mark.asyncio(loop_scope="module")

STEPS = 20
LATE_S = 1.0  # S comes this long after the instruction: the ranks must wait for it


class Group(DelayedRegion):
    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, STEPS)

    async def round0(self, job: str, training: TrainingConfig) -> RoundResult:
        return await self.group.run_round(self.first(job, training), 60)

    async def eager(self, job: str, training: TrainingConfig) -> RoundInstruction:
        """Write round 1's eager instruction (θ_1 promised at ``<job>-1.pt``)."""
        spec = next_instruction(
            self.first(job, training), str(self.workdir / f"{job}-1.pt"), "eager"
        )
        await asyncio.to_thread(self.handoff.write_instruction, spec)
        return spec

    def rank_log(self) -> str:
        return (self.workdir / "logs" / "rank-0.log").read_text(errors="replace")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def region(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Group]:
    state = Group(tmp_path_factory.mktemp("eager"))
    await state.group.start()
    yield state
    await state.group.stop()


def assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=1e-5, atol=1e-6)


def nudged(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A start that is neither θ_0 nor the group's own parameters."""
    generator = torch.Generator().manual_seed(11)
    return {
        name: t + 0.05 * torch.randn(t.shape, generator=generator, dtype=t.dtype)
        for name, t in params.items()
    }


@on_module_loop
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
async def test_an_eager_round_trains_from_s_on_every_rank(region: Group, parallelism: str) -> None:
    training = TrainingConfig(parallelism=parallelism)  # type: ignore[arg-type]
    # The reference first (the group must hold the eager job's round 0 when its round 1
    # comes): a serial round 1 from θ = S, after the same round 0.
    serial_job = f"serial-{parallelism}"
    start = nudged((await region.round0(serial_job, training)).params)
    base = save_state(region.workdir / f"{serial_job}-1.pt", start)
    reference = await region.group.run_round(
        instruction(serial_job, 1, base, inner_steps=STEPS, training=training, overlap="delayed"),
        60,
    )

    job = f"eager-{parallelism}"
    await region.round0(job, training)
    await region.eager(job, training)
    await asyncio.sleep(LATE_S)
    s_hash = parameters_vector_hash(start)
    region.handoff.write_start(job, 1, start, s_hash)
    theta1 = save_state(region.workdir / f"{job}-1.pt", start)
    region.handoff.write_base_ready(BaseReady(job, 1, str(theta1), s_hash))
    result = await region.group.collect_round(job, 1, 60)

    assert result.summary.base_folded_at_step is not None
    assert result.summary.base_params_hash == s_hash
    assert result.summary.cursor == reference.summary.cursor
    assert_close(result.params, reference.params)
    waits = [
        float(m.group(1))
        for m in re.finditer(
            rf"job {job} round 1: starting from the eager estimate S {s_hash} "
            r"\(([0-9.]+) s waited for it\)",
            region.rank_log(),
        )
    ]
    assert len(waits) == 1
    assert waits[0] >= LATE_S / 2


@on_module_loop
async def test_a_marker_without_s_keeps_the_local_start(region: Group) -> None:
    training = TrainingConfig()
    job = "no-estimate"
    first = await region.round0(job, training)
    await region.eager(job, training)
    region.handoff.write_start(job, 1, None, reason="StateError")
    theta1 = save_state(region.workdir / f"{job}-1.pt", first.params)
    ready = BaseReady(job, 1, str(theta1), parameters_vector_hash(first.params))
    region.handoff.write_base_ready(ready)
    result = await region.group.collect_round(job, 1, 60)
    assert result.summary.base_params_hash == ready.base_hash
    # θ_1 = y_0 and a local start: as a serial round 1 from y_0 would train.
    serial_job = "no-estimate-serial"
    await region.round0(serial_job, training)
    base = save_state(region.workdir / f"{serial_job}-1.pt", first.params)
    serial = await region.group.run_round(
        instruction(serial_job, 1, base, inner_steps=STEPS, training=training, overlap="delayed"),
        60,
    )
    assert_close(result.params, serial.params)
    assert (
        f"job {job} round 1: no eager estimate (StateError); starting from the local parameters"
        in region.rank_log()
    )


@on_module_loop
async def test_an_s_that_does_not_match_its_hash_ends_the_round(region: Group) -> None:
    training = TrainingConfig()
    job = "bad-s"
    first = await region.round0(job, training)
    await region.eager(job, training)
    region.handoff.write_start(job, 1, nudged(first.params), "0" * 64)
    with pytest.raises(RoundFailed, match="hashes"):
        await region.group.collect_round(job, 1, 60)


@on_module_loop
async def test_a_cancel_while_waiting_for_s_ends_the_round(region: Group) -> None:
    training = TrainingConfig()
    job = "cancel-waiting"
    await region.round0(job, training)
    await region.eager(job, training)
    await asyncio.sleep(LATE_S)
    region.handoff.request_cancel(job, 1)
    with pytest.raises(RoundFailed, match="cancelled"):
        await region.group.collect_round(job, 1, 60)
    assert region.handoff.read_progress(job, 1) is None  # not one step trained
