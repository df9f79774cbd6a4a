"""A round stopped mid-way keeps its inner state; the restarted group resumes the very
same round from it, bit for bit, and discards it for any other round.

Real processes: 2-rank gloo worker groups under ``torch.distributed.run``. A reference
group trains rounds 0, 1 and 3 of the job uninterrupted. The group under test trains
round 0, is stopped mid-way through round 1 (the agent's stop, as at the end of a drain),
and restarted: it resumes round 1 at the step it stopped before, and its result equals
the reference's exactly. It is then stopped mid-way through round 2, restarted and asked
for round 3 instead (the federation moved on): it discards round 2's inner state, saying
why, and trains round 3 from its start, again exactly as the reference. Faults injected
last: a torn file is discarded, and inner state that does not load fails the round once
(then the round trains from its start). The same resume
holds for FSDP2 (sharded parameters and optimizer state) with gradient accumulation,
clipping and a warmup-cosine schedule.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from geofed.params import parameters_vector_hash
from geofed.training_config import LrSchedule, TrainingConfig
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.messages import RoundInstruction, RoundResult
from regional_agent.launch.launcher import LocalElasticLauncher
from regional_agent.launch.worker_group import (
    RoundFailed,
    WorkerGroup,
    WorkerGroupConfig,
    WorkerGroupNotRunning,
)
from regional_agent.worker.inner_checkpoint import (
    InnerCheckpoint,
    RankInner,
    RoundIdentity,
    instruction_digest,
    read_inner_checkpoint,
    write_inner_checkpoint,
)
from regional_agent.worker.inner_loop import RankTotals
from tests.support.tiny_task import TinyTask
from tests.support.worker_group import (
    STEPS,
    instruction,
    launcher_config,
    save_state,
    wait_for_progress,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

JOB = "spot"
OPTIONS = {"step_delay_s": 0.03}


def group_at(workdir: Path) -> WorkerGroup:
    launcher = LocalElasticLauncher(workdir, launcher_config())
    return WorkerGroup(workdir, launcher, WorkerGroupConfig(start_timeout_s=120.0))


def bases(directory: Path) -> dict[int, Path]:
    """A different θ for every round (as if the federation moved it)."""
    directory.mkdir(exist_ok=True)
    return {
        r: save_state(directory / f"theta-{r}.pt", TinyTask().build_model(seed=20 + r).state_dict())
        for r in range(6)
    }


def assert_identical(result: RoundResult, reference: RoundResult) -> None:
    assert result.params.keys() == reference.params.keys()
    for name, tensor in reference.params.items():
        assert result.params[name].dtype == tensor.dtype
        assert torch.equal(result.params[name], tensor), name
    # The hash is of the parameters' bytes: equal hashes are bit-identical parameters.
    for name in ("steps", "tokens", "mean_loss", "cursor", "base_params_hash", "params_hash"):
        assert getattr(result.summary, name) == getattr(reference.summary, name), name


def log_since(handoff: HandoffDir, offset: int) -> str:
    """Rank 0's log from byte ``offset`` on."""
    return handoff.rank_log_path(0).read_bytes()[offset:].decode()


async def stop_mid_round(
    group: WorkerGroup, workdir: Path, round_: int, base: Path, **fields: object
) -> int:
    """Start ``round_``, stop the group a few steps in; return the step it kept."""
    handoff = HandoffDir(workdir)
    inst = instruction(JOB, round_, base, task_options=OPTIONS, **fields)
    task = asyncio.create_task(group.run_round(inst, 120))
    await wait_for_progress(handoff, JOB, round_, steps=4)
    assert await group.stop() == 0
    with pytest.raises(WorkerGroupNotRunning):
        await task
    assert handoff.read_done(JOB, round_) is None
    kept = read_inner_checkpoint(handoff.inner_checkpoint_path(JOB))
    assert kept is not None
    assert (kept.identity.job, kept.identity.round, kept.inner_steps) == (JOB, round_, STEPS)
    assert 4 <= kept.step < STEPS
    assert len(kept.ranks) == 2
    assert f"job {JOB} round {round_}: stopped before step {kept.step} of {STEPS}" in (
        handoff.rank_log_path(0).read_text()
    )
    return kept.step


async def test_a_round_stopped_mid_way_resumes_bit_identically_and_only_itself(
    tmp_path: Path,
) -> None:
    theta = bases(tmp_path / "bases")
    reference_dir, spot_dir = tmp_path / "reference", tmp_path / "spot"

    reference: dict[int, RoundResult] = {}
    group = group_at(reference_dir)
    await group.start()
    try:
        for round_ in (0, 1, 3, 4, 5):
            inst = instruction(JOB, round_, theta[round_], task_options=OPTIONS)
            reference[round_] = await group.run_round(inst, 120)
    finally:
        await group.stop()
    assert not HandoffDir(reference_dir).inner_checkpoint_path(JOB).exists()

    handoff = HandoffDir(spot_dir)
    group = group_at(spot_dir)
    await group.start()
    await group.run_round(instruction(JOB, 0, theta[0], task_options=OPTIONS), 120)
    step = await stop_mid_round(group, spot_dir, 1, theta[1])

    # Before the start: a restarted group takes up the instruction its predecessor left
    # pending at once, possibly before start() returns.
    log_offset = handoff.rank_log_path(0).stat().st_size
    group = group_at(spot_dir)
    await group.start()
    try:
        resumed = await group.run_round(instruction(JOB, 1, theta[1], task_options=OPTIONS), 120)
        since = log_since(handoff, log_offset)
        assert f"job {JOB} round 1: resuming at step {step} of {STEPS}" in since, since
        assert_identical(resumed, reference[1])
        # The result is out: the inner state is gone.
        assert not handoff.inner_checkpoint_path(JOB).exists()
        await stop_mid_round(group, spot_dir, 2, theta[2])
    finally:
        await group.stop()
    # The federation moved on: the agent asks for round 3, never again for round 2.
    handoff.instruction_path(JOB, 2).unlink()

    # Before the start: a restarted group takes up the instruction its predecessor left
    # pending at once, possibly before start() returns.
    log_offset = handoff.rank_log_path(0).stat().st_size
    group = group_at(spot_dir)
    await group.start()
    try:
        third = await group.run_round(instruction(JOB, 3, theta[3], task_options=OPTIONS), 120)
        since = log_since(handoff, log_offset)
        assert (
            f"job {JOB} round 3: discarding the inner checkpoint: it is of job {JOB} round 2"
            in since
        ), since
        assert "resuming" not in since
        assert_identical(third, reference[3])
        assert not handoff.inner_checkpoint_path(JOB).exists()

        # A torn file is discarded, saying why, and the round trained from its start.
        path = handoff.inner_checkpoint_path(JOB)
        path.write_bytes(b"torn")
        log_offset = handoff.rank_log_path(0).stat().st_size
        fourth = await group.run_round(instruction(JOB, 4, theta[4], task_options=OPTIONS), 120)
        since = log_since(handoff, log_offset)
        assert f"job {JOB} round 4: discarding the inner checkpoint: {path}: unreadable" in since
        assert_identical(fourth, reference[4])
        assert not path.exists()

        # Inner state of the very round that does not load: the round is refused, the file
        # goes, and asked again the group trains the round from its start.
        fifth = instruction(JOB, 5, theta[5], task_options=OPTIONS)
        write_inner_checkpoint(path, unloadable(fifth, theta[5], after_round=4, cursor=4 * STEPS))
        with pytest.raises(RoundFailed, match="cannot resume from the inner checkpoint"):
            await group.run_round(fifth, 120)
        assert not path.exists()
        assert_identical(await group.run_round(fifth, 120), reference[5])
    finally:
        await group.stop()


def unloadable(
    inst: RoundInstruction, base: Path, *, after_round: int, cursor: int
) -> InnerCheckpoint:
    """Inner state that names ``inst``'s round exactly but whose tensors were never saved."""
    theta = torch.load(base, weights_only=True)
    identity = RoundIdentity(
        job=inst.job,
        round=inst.round,
        base_hash=parameters_vector_hash(theta),
        instruction=instruction_digest(inst),
        world_size=2,
        after_round=after_round,
        start_cursor=cursor,
    )
    totals = RankTotals(5, 20, 1.0, 0.01, math.nan, 0.1)
    rank = RankInner(torch.get_rng_state(), None, totals)
    return InnerCheckpoint(identity, 5, inst.inner_steps, (rank, rank))


SHARDED = TrainingConfig(
    parallelism="fsdp",
    grad_accumulation=2,
    grad_clip_norm=0.05,
    lr_schedule=LrSchedule(kind="warmup_cosine", warmup_steps=8, min_lr_ratio=0.1),
)


async def test_a_sharded_accumulating_scheduled_round_resumes_bit_identically(
    tmp_path: Path,
) -> None:
    theta = bases(tmp_path / "bases")
    reference_dir, spot_dir = tmp_path / "reference", tmp_path / "spot"
    fields: dict[str, object] = {"training": SHARDED, "total_steps": 2 * STEPS}

    def inst(round_: int) -> RoundInstruction:
        return instruction(JOB, round_, theta[round_], task_options=OPTIONS, **fields)

    group = group_at(reference_dir)
    await group.start()
    try:
        await group.run_round(inst(0), 120)
        reference = await group.run_round(inst(1), 120)
    finally:
        await group.stop()

    handoff = HandoffDir(spot_dir)
    group = group_at(spot_dir)
    await group.start()
    await group.run_round(inst(0), 120)
    step = await stop_mid_round(group, spot_dir, 1, theta[1], **fields)
    kept = read_inner_checkpoint(handoff.inner_checkpoint_path(JOB))
    assert kept is not None
    assert kept.ranks[0].totals.micro_batches == 2 * step  # two micro-batches a step

    # Before the start: a restarted group takes up the instruction its predecessor left
    # pending at once, possibly before start() returns.
    log_offset = handoff.rank_log_path(0).stat().st_size
    group = group_at(spot_dir)
    await group.start()
    try:
        resumed = await group.run_round(inst(1), 120)
        since = log_since(handoff, log_offset)
        assert f"job {JOB} round 1: resuming at step {step} of {STEPS}" in since, since
        assert_identical(resumed, reference)
    finally:
        await group.stop()
