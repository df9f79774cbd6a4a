"""The region's training loop with real processes: 2 gloo ranks under torch.distributed.run.

One group serves the module: gradient accumulation, clipping and the learning-rate
schedule against a replay in this process (DDP, fp32); FSDP2 against DDP; a worker
killed mid-round under FSDP (optimizer state and schedule resume exactly); bf16 under
both; a Llama with a complex RoPE buffer, per-block FSDP units and activation
checkpointing; the base parameters evaluated by the ranks before training, under DDP
and FSDP; a job asking to checkpoint a model with nothing to checkpoint; what the
rounds measured (step time, throughput, learning rate, gradient norm, all-reduce time,
each rank's own busy time); a rank slowed on purpose found straggling; and last a clean
stop of a group that ran sharded jobs.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from coordinator.publication.evaluation_process import evaluate_params
from geofed.lr_schedule import apply_lr, job_step, lr_factor
from geofed.params import federated_names, parameters_vector_hash
from geofed.task import DataShard, load_task
from geofed.training_config import LrSchedule, Parallelism, TrainingConfig
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.messages import RoundResult
from regional_agent.launch.launcher import LocalElasticLauncher
from regional_agent.launch.worker_group import RoundFailed, WorkerGroup, WorkerGroupConfig
from regional_agent.rounds.stragglers import StragglerRule, StragglerWatch
from regional_agent.worker.optimizer_checkpoint import read_optimizer_state
from tests.support.global_updates import chained_theta
from tests.support.pki import make_federation
from tests.support.tiny_task import TinyTask
from tests.support.worker_group import (
    STEPS,
    WORLD,
    instruction,
    launcher_config,
    save_state,
    wait_for_progress,
)

pytestmark = pytest.mark.integration
on_module_loop = pytest.mark.asyncio(loop_scope="module")

ROUNDS = 3
TOTAL = ROUNDS * STEPS
SCHEDULE = LrSchedule(kind="warmup_cosine", warmup_steps=8, min_lr_ratio=0.1)
# Clipped at a norm the tiny task's gradients exceed, so clipping changes every step.
TUNED = TrainingConfig(grad_accumulation=2, grad_clip_norm=0.05, lr_schedule=SCHEDULE)
TUNED_FSDP = TUNED.model_copy(update={"parallelism": "fsdp"})
# Shard groups of one rank, replicated across the two: HSDP's replicate dimension at work.
TUNED_HSDP = TrainingConfig.model_validate(
    {**TUNED.record(), "parallelism": "hsdp", "hsdp_shard_ranks": 1}
)
LLAMA = "geofed.examples.llama:LlamaTask"
LLAMA_OPTIONS = {
    "dim": 32,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_dim": 64,
    "seq_len": 16,
    "batch_size": 2,
}


class Group:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.handoff = HandoffDir(workdir)
        self.launcher = LocalElasticLauncher(workdir, launcher_config())
        self.group = WorkerGroup(workdir, self.launcher, WorkerGroupConfig(start_timeout_s=120.0))
        self.theta0 = TinyTask().build_model(seed=3).state_dict()
        self.base0 = save_state(workdir / "theta0.pt", self.theta0)

    async def rounds(
        self, job: str, rounds: int, training: TrainingConfig, *, chained: bool = False
    ) -> list[RoundResult]:
        """Rounds 0..rounds-1 of ``job``; each from θ0, or from the previous result."""
        results: list[RoundResult] = []
        base = self.base0
        for round_ in range(rounds):
            inst = instruction(job, round_, base, training=training, total_steps=TOTAL)
            results.append(await self.group.run_round(inst, 60))
            if chained:
                base = save_state(self.workdir / f"{job}-{round_ + 1}.pt", results[-1].params)
        return results


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def region(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Group]:
    state = Group(tmp_path_factory.mktemp("training"))
    await state.group.start()
    yield state
    await state.group.stop()


def replay(
    task: TinyTask, base: dict[str, torch.Tensor], training: TrainingConfig, rounds: int
) -> list[dict[str, torch.Tensor]]:
    """What a DDP region of WORLD ranks computes, in this process: each round from
    ``base``, each step the mean over ranks of the accumulated micro-batch gradients,
    clipped, at the scheduled rate."""
    model = task.build_model()
    optimizer = task.build_optimizer(model.parameters())
    accumulation = training.grad_accumulation
    cursor = 0
    results = []
    for round_ in range(rounds):
        model.load_state_dict(base)
        for step in range(STEPS):
            factor = lr_factor(training.lr_schedule, job_step(round_, STEPS, step), TOTAL)
            apply_lr(optimizer, factor)
            grads = []
            for rank in range(WORLD):
                shard = DataShard("eu-west", 0, 2, rank, WORLD, 7)
                model.zero_grad(set_to_none=True)
                for micro in range(accumulation):
                    batch = task.batch_at(shard, cursor + micro)
                    (task.loss(model, batch) / accumulation).backward()
                grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            for param, *per_rank in zip(model.parameters(), *grads, strict=True):
                param.grad = sum(per_rank) / WORLD
            if training.grad_clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), training.grad_clip_norm)
            optimizer.step()
            cursor += accumulation
        results.append({k: v.clone() for k, v in model.state_dict().items()})
    return results


def assert_states_close(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], **tolerance: float
) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, **tolerance)  # type: ignore[arg-type]


def scheduled_lr(round_: int) -> float:
    """The tiny task's rate at the last step of ``round_`` (its base rate is 1e-2)."""
    return 1e-2 * lr_factor(SCHEDULE, job_step(round_, STEPS, STEPS - 1), TOTAL)


@on_module_loop
async def test_accumulation_clipping_and_schedule_match_a_replay(region: Group) -> None:
    results = await region.rounds("tuned", 2, TUNED)

    expected = replay(TinyTask(), region.theta0, TUNED, rounds=2)
    for result, reference in zip(results, expected, strict=True):
        assert_states_close(result.params, reference, rtol=1e-5, atol=1e-6)
    batch = TinyTask().options.batch_size
    assert [r.summary.cursor for r in results] == [2 * STEPS, 4 * STEPS]  # micro-batches
    assert results[0].summary.steps == STEPS
    assert results[0].summary.tokens == WORLD * STEPS * 2 * batch
    # Clipping bounded the updates: without it the same data and rates land elsewhere.
    unclipped = replay(
        TinyTask(), region.theta0, TUNED.model_copy(update={"grad_clip_norm": None}), 1
    )
    assert any(
        not torch.allclose(unclipped[0][name], results[0].params[name], atol=1e-4)
        for name in unclipped[0]
    )
    # The schedule went on from round 0 into round 1 (job steps 20..39), not from 0.
    checkpoint = region.handoff.read_checkpoint("tuned")
    assert checkpoint is not None
    assert checkpoint.parallelism == "ddp"
    optimizer_state = read_optimizer_state(region.handoff, "tuned")
    assert optimizer_state is not None
    group = optimizer_state["param_groups"][0]
    assert group["initial_lr"] == 1e-2
    assert math.isclose(group["lr"], scheduled_lr(1), rel_tol=1e-12)
    assert scheduled_lr(1) < scheduled_lr(0)


@on_module_loop
async def test_fsdp_trains_the_same_rounds_as_ddp(region: Group) -> None:
    ddp = [region.handoff.read_completed("tuned", r) for r in range(2)]
    fsdp = await region.rounds("tuned-fsdp", 2, TUNED_FSDP)

    for sharded, replicated in zip(fsdp, ddp, strict=True):
        assert replicated is not None
        assert sharded.params.keys() == replicated.params.keys()
        assert all(t.dtype == torch.float32 for t in sharded.params.values())
        assert_states_close(sharded.params, replicated.params, rtol=1e-5, atol=1e-6)
        for name in ("tokens", "cursor", "steps", "world_size", "base_params_hash"):
            assert getattr(sharded.summary, name) == getattr(replicated.summary, name), name
        assert math.isclose(sharded.summary.mean_loss, replicated.summary.mean_loss, rel_tol=1e-5)
    checkpoint = region.handoff.read_checkpoint("tuned-fsdp")
    assert checkpoint is not None
    assert (checkpoint.job, checkpoint.parallelism) == ("tuned-fsdp", "fsdp")
    # Saved by each rank, its shard, keyed by parameter name: loadable by a group of any
    # size; read back whole here.
    assert checkpoint.optimizer_round == 1
    saved = sorted(p.name for p in region.handoff.optimizer_path("tuned-fsdp", 1).iterdir())
    assert saved == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    optimizer_state = read_optimizer_state(region.handoff, "tuned-fsdp")
    assert optimizer_state is not None
    assert set(optimizer_state["state"]) == set(region.theta0)
    assert optimizer_state["state"]["0.weight"]["exp_avg"].shape == (16, 8)
    assert math.isclose(optimizer_state["param_groups"][0]["lr"], scheduled_lr(1), rel_tol=1e-12)


@on_module_loop
async def test_hsdp_trains_the_same_rounds_as_ddp(region: Group) -> None:
    ddp = [region.handoff.read_completed("tuned", r) for r in range(2)]
    hsdp = await region.rounds("tuned-hsdp", 2, TUNED_HSDP)

    for hybrid, replicated in zip(hsdp, ddp, strict=True):
        assert replicated is not None
        assert_states_close(hybrid.params, replicated.params, rtol=1e-5, atol=1e-6)
        assert (hybrid.summary.tokens, hybrid.summary.cursor) == (
            replicated.summary.tokens,
            replicated.summary.cursor,
        )
    checkpoint = region.handoff.read_checkpoint("tuned-hsdp")
    assert checkpoint is not None
    assert (checkpoint.parallelism, checkpoint.optimizer_round) == ("hsdp", 1)
    optimizer_state = read_optimizer_state(region.handoff, "tuned-hsdp")
    assert optimizer_state is not None
    assert optimizer_state["state"]["0.weight"]["exp_avg"].shape == (16, 8)
    log = region.handoff.rank_log_path(0).read_text()
    assert "job tuned-hsdp: hsdp, fp32 compute, on cpu" in log


@on_module_loop
async def test_fsdp_worker_killed_mid_round_resumes_state_and_schedule_exactly(
    region: Group,
) -> None:
    # Killed in round 1, past the warmup: it resumes from round 0's optimizer state.
    killed = 1
    reference = await region.rounds("fsdp-ref", killed + 1, TUNED_FSDP, chained=True)
    await region.rounds("fsdp-crash", killed, TUNED_FSDP, chained=True)
    restarts = region.group.restart_count

    last = instruction(
        "fsdp-crash",
        killed,
        region.workdir / f"fsdp-crash-{killed}.pt",
        task_options={"step_delay_s": 0.02},
        training=TUNED_FSDP,
        total_steps=TOTAL,
    )
    round_task = asyncio.create_task(region.group.run_round(last, 120))
    await wait_for_progress(region.handoff, "fsdp-crash", killed, steps=5)
    os.kill(region.launcher.worker_pids()[1], signal.SIGKILL)
    result = await round_task

    assert region.group.restart_count == restarts + 1
    expected = reference[-1]
    for name, tensor in expected.params.items():
        assert torch.equal(result.params[name], tensor), name
    assert result.summary.params_hash == expected.summary.params_hash
    checkpoint = region.handoff.read_checkpoint("fsdp-crash")
    assert checkpoint is not None
    assert checkpoint.last_round == killed
    optimizer_state = read_optimizer_state(region.handoff, "fsdp-crash")
    assert optimizer_state is not None
    assert math.isclose(
        optimizer_state["param_groups"][0]["lr"], scheduled_lr(killed), rel_tol=1e-12
    )


@on_module_loop
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
async def test_bf16_round_publishes_finite_fp32_parameters(region: Group, parallelism: str) -> None:
    fp32 = region.handoff.read_completed("tuned", 0)
    assert fp32 is not None
    training = TUNED.model_copy(update={"parallelism": parallelism, "precision": "bf16"})
    (result,) = await region.rounds(f"bf16-{parallelism}", 1, training)

    assert result.params.keys() == region.theta0.keys()
    for name, tensor in result.params.items():
        assert tensor.dtype == torch.float32, name
        assert torch.isfinite(tensor).all(), name
    assert any(not torch.equal(result.params[k], region.theta0[k]) for k in region.theta0)
    assert math.isfinite(result.summary.mean_loss)
    # The same training in bf16 arithmetic lands close to the fp32 one.
    assert_states_close(result.params, fp32.params, rtol=0.0, atol=2e-2)


@on_module_loop
async def test_llama_with_a_complex_buffer_under_fsdp_blocks_and_checkpointing(
    region: Group,
) -> None:
    task = load_task(LLAMA, LLAMA_OPTIONS)
    model = task.build_model()
    assert any(b.is_complex() for b in model.buffers())  # the RoPE table
    theta0 = {name: model.state_dict()[name] for name in federated_names(model)}
    base = save_state(region.workdir / "llama-0.pt", theta0)

    def llama(job: str, training: TrainingConfig) -> object:
        inst = instruction(
            job, 0, base, task=LLAMA, task_options=LLAMA_OPTIONS, inner_steps=3, training=training
        )
        return region.group.run_round(inst, 120)

    plain = await llama("llama-ddp", TrainingConfig())  # type: ignore[misc]
    sharded = await llama(  # type: ignore[misc]
        "llama-fsdp", TrainingConfig(parallelism="fsdp", activation_checkpointing=True)
    )
    assert plain.params.keys() == theta0.keys()  # the complex buffer is not federated
    assert any(not torch.equal(plain.params[k], theta0[k]) for k in theta0)
    assert_states_close(sharded.params, plain.params, rtol=1e-4, atol=1e-5)


@on_module_loop
async def test_the_ranks_evaluate_the_base_before_training_when_asked(region: Group) -> None:
    task = load_task(LLAMA, LLAMA_OPTIONS)
    model = task.build_model()
    theta0 = {name: model.state_dict()[name] for name in federated_names(model)}
    base = save_state(region.workdir / "llama-eval-0.pt", theta0)
    expected = evaluate_params(task, 0, theta0)
    for parallelism in ("ddp", "fsdp"):
        inst = instruction(
            f"llama-eval-{parallelism}",
            0,
            base,
            task=LLAMA,
            task_options=LLAMA_OPTIONS,
            inner_steps=1,
            training=TrainingConfig(parallelism=parallelism),
            evaluate_base=True,
        )
        result = await region.group.run_round(inst, 120)
        assert result.summary.base_eval is not None, parallelism
        assert result.summary.base_eval.keys() == expected.keys()
        for name, value in expected.items():
            assert math.isclose(result.summary.base_eval[name], value, rel_tol=1e-5), name
    # A round not asked to evaluate reports nothing.
    plain = region.handoff.read_completed("llama-ddp", 0)
    assert plain is not None
    assert plain.summary.base_eval is None


@on_module_loop
async def test_checkpointing_a_model_without_blocks_is_refused(region: Group) -> None:
    inst = instruction(
        "no-blocks", 0, region.base0, training=TrainingConfig(activation_checkpointing=True)
    )
    with pytest.raises(RoundFailed, match="declares no checkpoint_units"):
        await region.group.run_round(inst, 30)


@on_module_loop
async def test_rounds_report_what_the_region_measured(region: Group) -> None:
    ddp = region.handoff.read_completed("tuned", 1)
    fsdp = region.handoff.read_completed("tuned-fsdp", 1)
    unclipped = region.handoff.read_completed("llama-ddp", 0)
    assert ddp is not None
    assert fsdp is not None
    assert unclipped is not None
    params = sum(t.numel() for t in region.theta0.values())
    for result in (ddp, fsdp):
        stats = result.summary.stats
        assert stats is not None
        assert stats.step_seconds > 0
        assert stats.tokens_per_second > 0
        assert stats.tokens_per_second * stats.step_seconds * STEPS == pytest.approx(
            result.summary.tokens
        )
        assert 0 <= stats.data_wait_seconds < stats.step_seconds * STEPS
        assert math.isclose(stats.learning_rate, scheduled_lr(1), rel_tol=1e-12)
        # Before clipping: the tiny task's gradients exceed the clipping norm.
        assert stats.grad_norm > TUNED.grad_clip_norm  # type: ignore[operator]
        assert stats.flops_per_token == 6 * params  # the whole model's, sharded or not
        assert stats.peak_memory_bytes is None  # the CPU
        assert stats.accelerator is None
        assert [(t.rank, t.node) for t in stats.ranks] == [(0, 0), (1, 0)]
        assert all(0 <= t.data_wait_seconds <= stats.data_wait_seconds for t in stats.ranks)
    assert ddp.summary.stats is not None
    assert fsdp.summary.stats is not None
    assert math.isclose(ddp.summary.stats.grad_norm, fsdp.summary.stats.grad_norm, rel_tol=1e-4)
    # DDP's all-reduce is timed by its communication hook, FSDP's all-gathers and
    # reduce-scatters through its custom collectives, HSDP's all-reduce between its
    # replicas (here its only collective: shard groups of one rank) from each unit's
    # reduce to its all-reduce hook.
    hsdp = region.handoff.read_completed("tuned-hsdp", 1)
    assert hsdp is not None
    for timed in (ddp, fsdp, hsdp):
        stats = timed.summary.stats
        assert stats is not None
        assert stats.comm_seconds is not None
        assert 0 < stats.comm_seconds < stats.step_seconds * STEPS
        # So each rank's busy time (its step less its wait in a collective).
        for timing in stats.ranks:
            assert timing.busy_seconds is not None
            assert 0 <= timing.busy_seconds <= stats.step_seconds
    # Without clipping the norm is still measured.
    assert unclipped.summary.stats is not None
    assert math.isfinite(unclipped.summary.stats.grad_norm)
    assert unclipped.summary.stats.grad_norm > 0


@on_module_loop
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
async def test_a_slow_rank_is_the_busy_one_and_is_found_straggling(
    region: Group, parallelism: Parallelism
) -> None:
    # Rank 1 sleeps in every loss call. The ranks step together, so both take its time a
    # step; only rank 0 spends it waiting: in DDP's gradient all-reduce, in FSDP's
    # reduce-scatter of the gradients (the tiny task's model is one FSDP unit).
    delay = 0.02
    options = {"slow_rank": 1, "slow_rank_delay_s": delay}
    training = TrainingConfig(parallelism=parallelism)
    watch = StragglerWatch(StragglerRule(ratio=1.3, window=3, min_rounds=3))
    verdicts = []
    for round_ in range(3):
        inst = instruction(
            f"slow-rank-{parallelism}",
            round_,
            region.base0,
            task_options=options,
            training=training,
        )
        stats = (await region.group.run_round(inst, 60)).summary.stats
        assert stats is not None
        fast, slow = stats.ranks
        assert fast.busy_seconds is not None
        assert slow.busy_seconds is not None
        assert stats.step_seconds >= delay
        assert slow.busy_seconds >= delay
        assert slow.busy_seconds > 2 * fast.busy_seconds, stats.ranks
        verdicts.append(watch.observe(round_, stats.ranks))
    assert [v.ranks for v in verdicts] == [(), (), (1,)], verdicts
    assert verdicts[-1].nodes == (0,)
    host = socket.gethostname()
    assert f"rank 1 (node 0 on {host}) over 1.3x its peers' median busy time in 3 of" in (
        verdicts[-1].reason
    )


@on_module_loop
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
async def test_a_chained_update_changed_on_disk_refuses_the_round_on_every_rank(
    region: Group, tmp_path: Path, parallelism: str
) -> None:
    """Rank 0 reads θ only as it loads it into the group (hashing it as it goes): a chained
    update whose bytes changed after the agent verified it is found mid-load, its peers
    finish the load (broadcast under DDP, scattered under FSDP), and the round is refused
    on every rank at once (none waits out the collective timeout); with the byte restored
    the same group trains the round."""
    job = f"chained-{parallelism}"
    chain, stored, after = chained_theta(
        make_federation(tmp_path / "fed"), region.theta0, tmp_path, job=job
    )
    training = TrainingConfig(parallelism=parallelism)  # type: ignore[arg-type]
    inst = instruction(job, 1, chain, training=training, total_steps=TOTAL)
    data = bytearray(stored.path.read_bytes())
    where = stored.start + sum(stored.sizes[:-1]) - 20  # inside the last chunk's frame
    data[where] ^= 0x01
    stored.path.write_bytes(bytes(data))
    started = asyncio.get_running_loop().time()
    with pytest.raises(RoundFailed, match=rf"ThetaChainError: update of round 0 at {stored.path}"):
        await region.group.run_round(inst, 40)
    assert asyncio.get_running_loop().time() - started < 30  # not the 60 s timeout
    data[where] ^= 0x01
    stored.path.write_bytes(bytes(data))
    trained = await region.group.run_round(inst, 60)
    assert trained.summary.base_params_hash == parameters_vector_hash(after)


@on_module_loop
async def test_the_group_stops_cleanly_after_sharded_jobs(region: Group) -> None:
    assert await region.group.stop() == 0  # every worker exited 0
    for rank in range(WORLD):
        assert "worker stopped cleanly" in region.handoff.rank_log_path(rank).read_text()
