"""A round stopped mid-way keeps its inner state; the restarted group resumes the very
same round from it, bit for bit, and discards it for any other round.

Real processes: 2-rank gloo worker groups under ``torch.distributed.run``. A reference
group, one for the module, trains rounds 0, 1, 3, 4 and 5 of the job uninterrupted. The
group under test trains round 0, is stopped mid-way through round 1 (the agent's stop, as
at the end of a drain), and restarted: it resumes round 1 at the step it stopped before,
and its result equals the reference's exactly. It is then stopped mid-way through round
2, restarted and asked for round 3 instead (the federation moved on): it discards round
2's inner state, saying why, and trains round 3 from its start, again exactly as the
reference. Faults injected last: a torn file is discarded, and inner state that does not
load fails the round once (then the round trains from its start). The same resume
holds for FSDP2 (sharded parameters and optimizer state) with gradient accumulation,
clipping and a warmup-cosine schedule (its own job in the reference group): the group
under test, still running after round 5 (one launch fewer: each costs seconds), trains
that job's round 0, is stopped mid-way through its round 1, restarted and resumes it.
Run alone, or after the first test failed, the sharded test starts a group of its own.

The rounds the tests stop mid-way are slowed down, to be caught in the middle (a launch
builds a job's task, pace and all, for the first round of it it trains: job spot runs at
full speed from round 3 on); the reference trains each round from the very instruction
the group under test gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
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
on_module_loop = pytest.mark.asyncio(loop_scope="module")

JOB = "spot"
SHARDED_JOB = "spot-sharded"
#: The pace of a launch the test stops mid-way: 20 steps take over half a second.
PACED = {"step_delay_s": 0.03}


def group_at(workdir: Path) -> WorkerGroup:
    launcher = LocalElasticLauncher(workdir, launcher_config())
    config = WorkerGroupConfig(start_timeout_s=120.0, poll_interval_s=0.02)
    return WorkerGroup(workdir, launcher, config)


def bases(directory: Path) -> dict[int, Path]:
    """A different θ for every round (as if the federation moved it)."""
    directory.mkdir(exist_ok=True)
    return {
        r: save_state(directory / f"theta-{r}.pt", TinyTask().build_model(seed=20 + r).state_dict())
        for r in range(6)
    }


class Reference:
    """The module's reference group, which trains every round uninterrupted. It starts in
    the background, beside the first group under test; a test has it train while a group
    under test starts (both are mostly waiting)."""

    def __init__(self, workdir: Path) -> None:
        self.handoff = HandoffDir(workdir)
        self.group = group_at(workdir)
        self.starting = asyncio.create_task(self.group.start())

    async def ready(self) -> None:
        await self.starting

    async def train(self, *instructions: RoundInstruction) -> dict[int, RoundResult]:
        """Each instruction's result, by round, trained one after another."""
        await self.ready()
        return {inst.round: await self.group.run_round(inst, 120) for inst in instructions}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Reference]:
    ref = Reference(tmp_path_factory.mktemp("reference"))
    try:
        yield ref
    finally:
        with contextlib.suppress(Exception):
            await ref.starting
        await ref.group.stop()
    # Uninterrupted and then stopped while idle, it never left inner state behind.
    for job in (JOB, SHARDED_JOB):
        assert not ref.handoff.inner_checkpoint_path(job).exists(), job


@dataclass
class Spot:
    """The group under test the first test leaves running for the sharded one, with its
    work dir (None until then, and once taken)."""

    workdir: Path | None = None
    group: WorkerGroup | None = None

    def take(self) -> tuple[Path, WorkerGroup] | None:
        if self.workdir is None or self.group is None:
            return None
        taken = self.workdir, self.group
        self.workdir, self.group = None, None
        return taken


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def spot() -> AsyncIterator[Spot]:
    left = Spot()
    yield left
    if left.group is not None:  # the sharded test did not take it
        await left.group.stop()


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


async def stop_mid_round(group: WorkerGroup, workdir: Path, inst: RoundInstruction) -> int:
    """Start ``inst``'s round, stop the group a few steps in; return the step it kept."""
    handoff = HandoffDir(workdir)
    job, round_ = inst.job, inst.round
    task = asyncio.create_task(group.run_round(inst, 120))
    await wait_for_progress(handoff, job, round_, steps=4)
    assert await group.stop() == 0
    with pytest.raises(WorkerGroupNotRunning):
        await task
    assert handoff.read_done(job, round_) is None
    kept = read_inner_checkpoint(handoff.inner_checkpoint_path(job))
    assert kept is not None
    assert (kept.identity.job, kept.identity.round, kept.inner_steps) == (job, round_, STEPS)
    assert 4 <= kept.step < STEPS
    assert len(kept.ranks) == 2
    assert f"job {job} round {round_}: stopped before step {kept.step} of {STEPS}" in (
        handoff.rank_log_path(0).read_text()
    )
    return kept.step


@on_module_loop
async def test_a_round_stopped_mid_way_resumes_bit_identically_and_only_itself(
    tmp_path: Path, reference: Reference, spot: Spot
) -> None:
    theta = bases(tmp_path / "bases")
    spot_dir = tmp_path / "spot"

    def inst(round_: int) -> RoundInstruction:
        # A launch builds the job's task, options and all, for the first round it trains:
        # the two launches stopped mid-way (rounds 0 to 2) are paced, the last one (rounds
        # 3 to 5) runs at full speed.
        options = PACED if round_ <= 2 else {}
        return instruction(JOB, round_, theta[round_], task_options=options)

    handoff = HandoffDir(spot_dir)
    group = group_at(spot_dir)
    try:
        await group.start()  # beside the reference group's start
        await reference.ready()  # nothing else runs while this group is stopped mid-round
        await group.run_round(inst(0), 120)
        step = await stop_mid_round(group, spot_dir, inst(1))
    finally:
        await group.stop()  # stopped already, unless the test failed before

    # Before the start: a restarted group takes up the instruction its predecessor left
    # pending at once, possibly before start() returns.
    log_offset = handoff.rank_log_path(0).stat().st_size
    group = group_at(spot_dir)
    try:
        # The reference trains while the group under test starts again.
        expected, _ = await asyncio.gather(
            reference.train(*(inst(r) for r in (0, 1, 3, 4, 5))), group.start()
        )
        assert not reference.handoff.inner_checkpoint_path(JOB).exists()
        resumed = await group.run_round(inst(1), 120)
        since = log_since(handoff, log_offset)
        assert f"job {JOB} round 1: resuming at step {step} of {STEPS}" in since, since
        assert_identical(resumed, expected[1])
        # The result is out: the inner state is gone.
        assert not handoff.inner_checkpoint_path(JOB).exists()
        await stop_mid_round(group, spot_dir, inst(2))
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
        third = await group.run_round(inst(3), 120)
        since = log_since(handoff, log_offset)
        assert (
            f"job {JOB} round 3: discarding the inner checkpoint: it is of job {JOB} round 2"
            in since
        ), since
        assert "resuming" not in since
        assert_identical(third, expected[3])
        assert not handoff.inner_checkpoint_path(JOB).exists()

        # A torn file is discarded, saying why, and the round trained from its start.
        path = handoff.inner_checkpoint_path(JOB)
        path.write_bytes(b"torn")
        log_offset = handoff.rank_log_path(0).stat().st_size
        fourth = await group.run_round(inst(4), 120)
        since = log_since(handoff, log_offset)
        assert f"job {JOB} round 4: discarding the inner checkpoint: {path}: unreadable" in since
        assert_identical(fourth, expected[4])
        assert not path.exists()

        # Inner state of the very round that does not load: the round is refused, the file
        # goes, and asked again the group trains the round from its start.
        fifth = inst(5)
        write_inner_checkpoint(path, unloadable(fifth, theta[5], after_round=4, cursor=4 * STEPS))
        with pytest.raises(RoundFailed, match="cannot resume from the inner checkpoint"):
            await group.run_round(fifth, 120)
        assert not path.exists()
        assert_identical(await group.run_round(fifth, 120), expected[5])
    except BaseException:
        await group.stop()
        raise
    # The sharded test goes on with this group, rather than start one of its own.
    spot.workdir, spot.group = spot_dir, group


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


@on_module_loop
async def test_a_sharded_accumulating_scheduled_round_resumes_bit_identically(
    tmp_path: Path, reference: Reference, spot: Spot
) -> None:
    theta = bases(tmp_path / "bases")
    fields: dict[str, object] = {"training": SHARDED, "total_steps": 2 * STEPS}

    def inst(round_: int) -> RoundInstruction:
        return instruction(SHARDED_JOB, round_, theta[round_], task_options=PACED, **fields)

    running = spot.take()
    if running is None:  # run alone, or after the first test failed: a group of its own
        spot_dir, group = tmp_path / "spot", group_at(tmp_path / "spot")
    else:  # the group the first test left running (it parks job spot for this one)
        spot_dir, group = running
    handoff = HandoffDir(spot_dir)

    async def first_round() -> None:
        if running is None:
            await group.start()
        await group.run_round(inst(0), 120)

    try:
        # The reference trains while the group under test starts and trains round 0.
        trained, _ = await asyncio.gather(reference.train(inst(0), inst(1)), first_round())
        expected = trained[1]
        assert not reference.handoff.inner_checkpoint_path(SHARDED_JOB).exists()

        step = await stop_mid_round(group, spot_dir, inst(1))
    finally:
        await group.stop()  # stopped already, unless the test failed before
    kept = read_inner_checkpoint(handoff.inner_checkpoint_path(SHARDED_JOB))
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
        assert f"job {SHARDED_JOB} round 1: resuming at step {step} of {STEPS}" in since, since
        assert_identical(resumed, expected)
    finally:
        await group.stop()
