"""Streaming rounds in a real worker group (2 gloo ranks under torch.distributed.run).

The agent's side is played through the hand-off directory, on the tiny task split in
F = 2 fragments. Round 0 is serial: rank 0's quantized delta (fp32 codec: lossless, so
the test can read the parameters back from it) names only fragment 0. Round 1 is
speculative: its θ_1 changes only fragment 0 (as the coordinator's does), the workers
fold in only that fragment, and every other tensor keeps its local progress. A ``plain``
job of the same seed and data, trained serially and handing over its parameters, gives
the parameters the streaming job must end with.
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
from geofed.codec import decode
from geofed.codec_params import CodecParams
from geofed.fragments import fragment_plan
from geofed.params import parameters_vector_hash
from geofed.training_config import TrainingConfig
from regional_agent.handoff.messages import BaseReady, DeltaRequest, RoundInstruction, RoundResult
from regional_agent.handoff.overlap import next_instruction
from regional_agent.handoff.residual_file import Residual, read_residual
from tests.support.tiny_task import TinyTask
from tests.support.worker_group import DelayedRegion, instruction, save_state, wait_for_progress

pytestmark = pytest.mark.integration
on_module_loop = pytest.mark.asyncio(loop_scope="module")

STEPS = 60  # long enough that θ can come while the round trains
SHORT = 20  # where θ is there before the first step, rounds need no length
FRAGMENTS = 2
CODEC = CodecParams(scheme="fp32")
THETA0 = TinyTask().build_model(seed=3).state_dict()
PLAN = fragment_plan({name: tuple(t.shape) for name, t in THETA0.items()}, FRAGMENTS)


class Region(DelayedRegion):
    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, STEPS)

    async def plain(
        self, job: str, round_: int, base: Path, training: TrainingConfig, steps: int = STEPS
    ) -> RoundResult:
        """A serial round handing over its parameters (the reference)."""
        step = instruction(
            job, round_, base, inner_steps=steps, training=training, overlap="delayed"
        )
        return await self.group.run_round(step, 60)

    def streaming(self, job: str, training: TrainingConfig, steps: int = STEPS) -> RoundInstruction:
        """Round 0 of a streaming job: the delta of fragment 0."""
        request = DeltaRequest(CODEC, str(self.workdir / job / "feedback.pt"), names=PLAN.names(0))
        return instruction(
            job,
            0,
            self.base0,
            inner_steps=steps,
            training=training,
            overlap="streaming",
            delta=request,
        )

    def theta1(self, job: str, fragment0: dict[str, torch.Tensor]) -> tuple[Path, str]:
        """θ_1 as the coordinator makes it: θ_0 with fragment 0 replaced, in θ's order."""
        theta = {name: fragment0.get(name, tensor) for name, tensor in THETA0.items()}
        return save_state(self.workdir / f"{job}-1.pt", theta), parameters_vector_hash(theta)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def region(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Region]:
    state = Region(tmp_path_factory.mktemp("streaming"))
    await state.group.start()
    yield state
    await state.group.stop()


def delta_of(result: RoundResult) -> dict[str, torch.Tensor]:
    """The (lossless) delta the workers handed over, by name, in its order."""
    assert result.delta is not None
    return decode(result.delta.to_bytes())


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


@on_module_loop
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
async def test_a_streaming_round_hands_its_fragment_and_folds_only_the_last_one(
    region: Region, parallelism: str
) -> None:
    training = TrainingConfig(parallelism=parallelism)  # type: ignore[arg-type]
    fragment0, fragment1 = PLAN.names(0), PLAN.names(1)
    assert fragment0
    assert fragment1

    # Round 0, serial: the delta names fragment 0 only, Δ = θ_0 - y_0 there.
    job = f"streaming-{parallelism}"
    reference0 = await region.plain(f"plain-{parallelism}", 0, region.base0, training, SHORT)
    first = region.streaming(job, training, SHORT)
    region.handoff.ask_checkpoint(job, 0)  # so that round 0 writes its residual's tensors
    result0 = await region.group.run_round(first, 60)
    delta0 = delta_of(result0)
    assert tuple(delta0) == fragment0
    for name in fragment0:
        assert torch.equal(delta0[name], THETA0[name] - reference0.params[name]), name
    assert result0.residual is not None
    residual = read_residual(result0.residual)
    assert isinstance(residual, Residual)
    assert set(residual.tensors) == set(fragment0)  # only tensors that were sent

    # Round 1, speculative: θ_1 moved fragment 0 (by an offset the test can see) and kept
    # the rest of θ_0. θ_1 is there before the first step, so it is folded in at step 0;
    # it is evaluated there, whole, and the other tensors are put back afterwards.
    moved = {name: reference0.params[name] + 0.05 for name in fragment0}
    theta1, theta1_hash = region.theta1(job, moved)
    region.handoff.write_base_ready(BaseReady(job, 1, str(theta1), theta1_hash, True))
    speculative = next_instruction(first, str(theta1), names=fragment1)
    assert speculative.fold == fragment0
    await asyncio.to_thread(region.handoff.write_instruction, speculative)
    result1 = await region.group.collect_round(job, 1, 60)
    assert result1.summary.base_folded_at_step == 0
    assert result1.summary.base_params_hash == theta1_hash
    expected = evaluate_params(TinyTask(), 1, torch.load(theta1, weights_only=True))
    assert result1.summary.base_eval is not None
    for metric, value in expected.items():
        assert math.isclose(result1.summary.base_eval[metric], value, rel_tol=1e-5), metric

    # What the workers trained from: fragment 0 at θ_1, every other tensor at its local
    # y_0 (not θ_1's, which is θ_0's): a serial round from exactly that.
    start = {
        name: (moved[name] if name in fragment0 else reference0.params[name]) for name in THETA0
    }
    base = save_state(region.workdir / f"plain-{parallelism}-1.pt", start)
    reference1 = await region.plain(f"plain-{parallelism}", 1, base, training, SHORT)
    delta1 = delta_of(result1)
    assert tuple(delta1) == fragment1
    for name in fragment1:
        # Δ_1 = θ_1 - y_1 on fragment 1, where θ_1 holds θ_0's values.
        assert_close(delta1[name], THETA0[name] - reference1.params[name])


@on_module_loop
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
async def test_a_fold_during_the_round_keeps_the_progress_of_every_tensor(
    region: Region, parallelism: str
) -> None:
    """θ_1 comes mid-round and equals y_0 on fragment 0: the fold changes nothing, so the
    round trains what a serial round from y_0 (every tensor) trains; a fold of the whole
    θ_1 would have thrown fragment 1 back to θ_0. Nothing is evaluated, so the workers
    load only the fragment they fold."""
    training = TrainingConfig(parallelism=parallelism)  # type: ignore[arg-type]
    fragment0, fragment1 = PLAN.names(0), PLAN.names(1)
    plain = f"plain-mid-{parallelism}"
    reference0 = await region.plain(plain, 0, region.base0, training)
    y0 = save_state(region.workdir / f"{plain}-1.pt", reference0.params)
    reference1 = await region.plain(plain, 1, y0, training)

    job = f"streaming-mid-{parallelism}"
    first = region.streaming(job, training)
    await region.group.run_round(first, 60)
    theta1, theta1_hash = region.theta1(job, {n: reference0.params[n] for n in fragment0})
    speculative = next_instruction(first, str(theta1), names=fragment1)
    await asyncio.to_thread(region.handoff.write_instruction, speculative)
    await wait_for_progress(region.handoff, job, 1, 3)
    region.handoff.write_base_ready(BaseReady(job, 1, str(theta1), theta1_hash))
    result1 = await region.group.collect_round(job, 1, 60)
    folded = result1.summary.base_folded_at_step
    assert folded is not None
    assert 1 <= folded <= STEPS
    delta1 = delta_of(result1)
    assert tuple(delta1) == fragment1
    for name in fragment1:
        assert_close(delta1[name], THETA0[name] - reference1.params[name])
