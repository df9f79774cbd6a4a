"""overlap_start: eager: the estimate's math (shared by agent and simulator), the agent's
state across rounds, and what crosses the hand-off and the control plane."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from benchmarks._federation_sim import RunSpec, delayed_start
from coordinator.rounds.records import announcement
from geofed.codec import dequantize, quantize_tensors
from geofed.codec_params import CodecParams
from geofed.control import RoundAnnouncement
from geofed.eager_start import EagerStartError, OuterReplica, estimate_mean
from geofed.outer_step import OuterOptimizer, OuterOptimizerConfig
from geofed.params import parameters_vector_hash
from geofed.training_config import TrainingConfig
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.errors import InvalidHandoffData
from regional_agent.handoff.messages import (
    RoundInstruction,
    RoundResult,
    RoundSummary,
    StartReady,
)
from regional_agent.handoff.overlap import next_instruction, speculation_unusable
from regional_agent.rounds.eager_start import EagerState, hand_start, next_state
from regional_agent.rounds.overlap_pipeline import DelayedRounds
from regional_agent.state import JobDirectory, ParamsVersion
from tests.support.agent_schedule import announce
from tests.support.handoff_samples import stream_file

NESTEROV = OuterOptimizerConfig(lr=0.7, momentum=0.9, momentum_warmup_rounds=2)
AVERAGE = OuterOptimizerConfig(kind="average")
REGIONS = 3


def _state(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "w": scale * torch.randn(4, 3, generator=generator),
        "b": scale * torch.randn(3, generator=generator),
    }


def _coordinator_chain(config: OuterOptimizerConfig, rounds: int) -> list[dict[str, torch.Tensor]]:
    """θ_0 .. θ_rounds as the coordinator's optimizer steps them on random mean deltas."""
    optimizer = OuterOptimizer(config)
    thetas = [_state(0)]
    for r in range(rounds):
        thetas.append(optimizer.step(thetas[-1], _state(100 + r, 0.1)))
    return thetas


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


# -- the math ------------------------------------------------------------------------


class _ReferenceReplica:
    """The simulator's replica as measured in benchmarks/results/overlap_sweep.md, kept
    here verbatim as the reference the shared module must reproduce bit for bit."""

    def __init__(self, config: OuterOptimizerConfig) -> None:
        self._config = config
        self._optimizer = OuterOptimizer(config)
        self.last_mean: dict[str, torch.Tensor] | None = None

    def observe(self, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
        cfg = self._config
        mu = cfg.momentum_at(self._optimizer.steps)
        buffers = self._optimizer.state_dict()["momentum_buffers"]
        mean: dict[str, torch.Tensor] = {}
        for name, old in before.items():
            direction = (old - after[name]) / cfg.lr
            if name in buffers:
                direction = direction - mu * mu * buffers[name]
            mean[name] = direction / (1.0 + mu)
        self._optimizer.step(before, mean)
        self.last_mean = mean

    def start(
        self,
        base: dict[str, torch.Tensor],
        local: dict[str, torch.Tensor],
        last_delta: dict[str, torch.Tensor] | None,
        regions: int,
    ) -> dict[str, torch.Tensor]:
        share = 1.0 / regions
        estimate: dict[str, torch.Tensor] = {}
        for name in base:
            fresh = base[name] - local[name]
            if last_delta is not None:
                fresh = fresh - last_delta[name]
            if self.last_mean is not None:
                estimate[name] = self.last_mean[name] + share * fresh
            else:
                estimate[name] = share * fresh
        trial = OuterOptimizer(self._config)
        trial.load_state_dict(self._optimizer.state_dict())
        return trial.step(base, estimate)


@pytest.mark.parametrize("config", [NESTEROV, AVERAGE], ids=["nesterov", "average"])
def test_the_agent_computes_the_simulators_start_bit_for_bit(
    config: OuterOptimizerConfig,
) -> None:
    thetas = _coordinator_chain(config, 4)
    spec = RunSpec(
        name="eager",
        method="diloco",
        regions=REGIONS,
        workers=1,
        rounds=4,
        inner_steps=1,
        seed=0,
        outer=config,
        overlap="delayed",
        delayed_start="eager",
    )
    sim_replica = OuterReplica(config)
    reference = _ReferenceReplica(config)
    sim_last: dict[str, torch.Tensor] | None = None
    saved: EagerState | None = None
    for r in range(4):
        local = _state(200 + r)
        theta = thetas[r]
        # The simulator: observe at the round's start, then delayed_start at its end.
        if r > 0:
            sim_replica.observe(thetas[r - 1], theta)
            reference.observe(thetas[r - 1], theta)
        sim_start = delayed_start(spec, theta, local, sim_last, sim_replica)
        _same(sim_start, reference.start(theta, local, sim_last, REGIONS))
        sim_last = {name: theta[name] - local[name] for name in theta}
        # The agent: replay lazily from its saved state, when round r has trained.
        before = thetas[r - 1] if r > 0 else None
        start, saved, replayed = next_state(
            saved, config, r, theta, parameters_vector_hash(theta), local, REGIONS, before
        )
        assert replayed == (r > 0)
        _same(start, sim_start)


def test_round_zero_steps_theta_on_the_own_delta_over_m() -> None:
    theta, local = _state(0), _state(1)
    start = OuterReplica(NESTEROV).start(theta, local, None, REGIONS)
    # First step: momentum 0 in the warm-up, so S = θ - lr·Δ/M.
    for name in theta:
        expected = theta[name].add((theta[name] - local[name]) / REGIONS, alpha=-NESTEROV.lr)
        assert torch.allclose(start[name], expected, atol=1e-6)


def test_the_average_kind_starts_from_theta_minus_the_estimate() -> None:
    thetas = _coordinator_chain(AVERAGE, 1)
    replica = OuterReplica(AVERAGE)
    replica.observe(thetas[0], thetas[1])
    last_delta, local = _state(5, 0.1), _state(6)
    mean = estimate_mean(thetas[1], local, last_delta, replica.last_mean, REGIONS)
    start = replica.start(thetas[1], local, last_delta, REGIONS)
    _same(start, {name: thetas[1][name] - mean[name] for name in mean})
    # The observed mean is θ_0 - θ_1 (lr 1, no momentum).
    for name in mean:
        assert replica.last_mean is not None
        assert torch.allclose(replica.last_mean[name], thetas[0][name] - thetas[1][name])


def test_the_replica_recovers_the_coordinators_means_and_momentum() -> None:
    optimizer = OuterOptimizer(NESTEROV)
    replica = OuterReplica(NESTEROV)
    theta = _state(0)
    for r in range(5):
        mean = _state(100 + r, 0.1)
        after = optimizer.step(theta, mean)
        replica.observe(theta, after)
        assert replica.last_mean is not None
        for name in mean:
            assert torch.allclose(replica.last_mean[name], mean[name], atol=1e-4), (r, name)
        theta = after
    probe = _state(9, 0.1)
    expected = OuterOptimizer.from_state_dict(optimizer.state_dict()).step(theta, probe)
    for name, tensor in replica.estimate(theta, probe).items():
        assert torch.allclose(tensor, expected[name], atol=1e-4)


def test_the_replica_state_round_trips_and_refuses_another_config(tmp_path: Path) -> None:
    thetas = _coordinator_chain(NESTEROV, 2)
    replica = OuterReplica(NESTEROV)
    replica.observe(thetas[0], thetas[1])
    torch.save(replica.state_dict(), tmp_path / "r.pt")
    loaded = OuterReplica.from_state_dict(
        torch.load(tmp_path / "r.pt", weights_only=True), NESTEROV
    )
    local = _state(7)
    _same(loaded.start(thetas[1], local, None, 2), replica.start(thetas[1], local, None, 2))
    with pytest.raises(EagerStartError, match="saved with"):
        OuterReplica.from_state_dict(replica.state_dict(), AVERAGE)
    with pytest.raises(EagerStartError):
        OuterReplica.from_state_dict({"version": 99}, NESTEROV)


def test_a_late_replica_starts_at_the_coordinators_step_count() -> None:
    assert OuterReplica(NESTEROV, steps=7).steps == 7
    assert OuterReplica(NESTEROV).steps == 0


# -- the agent's state across rounds -----------------------------------------------


def _hold(job: JobDirectory, round_: int, theta: dict[str, torch.Tensor]) -> Path:
    return job.save_params(ParamsVersion(round_, parameters_vector_hash(theta)), theta)


def _hand(
    job: JobDirectory, handoff: HandoffDir, round_: int, theta: dict[str, torch.Tensor], seed: int
) -> StartReady:
    path = _hold(job, round_, theta)
    return hand_start(
        job,
        handoff,
        NESTEROV,
        round_,
        str(path),
        parameters_vector_hash(theta),
        _state(seed),
        REGIONS,
    )


def test_the_agent_hands_s_over_and_keeps_the_replica_between_rounds(tmp_path: Path) -> None:
    job = JobDirectory(tmp_path / "state", "job-a")
    handoff = HandoffDir(tmp_path / "workers")
    thetas = _coordinator_chain(NESTEROV, 2)
    expected: EagerState | None = None
    for r in range(3):
        ready = _hand(job, handoff, r, thetas[r], 300 + r)
        start, expected, replayed = next_state(
            expected,
            NESTEROV,
            r,
            thetas[r],
            parameters_vector_hash(thetas[r]),
            _state(300 + r),
            REGIONS,
            thetas[r - 1] if r else None,
        )
        assert replayed == (r > 0)
        assert handoff.read_start_ready("job-a", r + 1) == ready
        assert ready.start_hash == parameters_vector_hash(start)
        _same(torch.load(ready.start_params, weights_only=True), start)
    saved = job.load_eager()
    assert saved is not None
    assert (saved["theta_round"], saved["delta_round"]) == (2, 2)


def test_a_resync_or_a_lost_theta_starts_the_replica_at_zero(tmp_path: Path) -> None:
    job = JobDirectory(tmp_path / "state", "job-a")
    handoff = HandoffDir(tmp_path / "workers")
    thetas = _coordinator_chain(NESTEROV, 3)
    _hand(job, handoff, 0, thetas[0], 1)
    job.forget_params()  # a resync
    assert job.load_eager() is None
    _hand(job, handoff, 1, thetas[1], 2)
    fresh, _, _ = next_state(
        None, NESTEROV, 1, thetas[1], parameters_vector_hash(thetas[1]), _state(2), REGIONS, None
    )
    ready = handoff.read_start_ready("job-a", 2)
    assert ready is not None
    _same(torch.load(ready.start_params, weights_only=True), fresh)
    # θ_1 gone before round 2's estimate: no replay.
    job.params_path(1).unlink()
    _hand(job, handoff, 2, thetas[2], 3)
    fresh, _, _ = next_state(
        None, NESTEROV, 2, thetas[2], parameters_vector_hash(thetas[2]), _state(3), REGIONS, None
    )
    ready = handoff.read_start_ready("job-a", 3)
    assert ready is not None
    _same(torch.load(ready.start_params, weights_only=True), fresh)


def test_no_estimate_hands_a_marker_without_s_and_drops_the_state(tmp_path: Path) -> None:
    job = JobDirectory(tmp_path / "state", "job-a")
    handoff = HandoffDir(tmp_path / "workers")
    _hand(job, handoff, 0, _state(0), 1)
    assert job.load_eager() is not None
    ready = hand_start(
        job, handoff, NESTEROV, 1, str(tmp_path / "missing.pt"), "h" * 64, _state(1), REGIONS
    )
    assert (ready.start_params, ready.start_hash) == ("", "")
    assert ready.reason == "ThetaFileError"
    assert handoff.read_start_ready("job-a", 2) == ready
    assert job.load_eager() is None


def test_a_quantized_delta_s_stream_stands_for_what_the_coordinator_decodes(
    tmp_path: Path,
) -> None:
    theta, local = _state(7), _state(8)
    quantized, _ = quantize_tensors(
        {n: theta[n] - local[n] for n in theta}, CodecParams(scheme="int8")
    )
    stream = stream_file(tmp_path / "round-0.delta.bin", quantized)
    decoded = dequantize(quantized)
    seen = {n: theta[n] - decoded[n] for n in theta}  # what the coordinator receives
    by_delta = JobDirectory(tmp_path / "a", "job-a")
    path = _hold(by_delta, 0, theta)
    handoff = HandoffDir(tmp_path / "workers-a")
    ready = hand_start(
        by_delta, handoff, NESTEROV, 0, str(path), parameters_vector_hash(theta), {}, 3, stream
    )
    want, _, _ = next_state(None, NESTEROV, 0, theta, parameters_vector_hash(theta), seen, 3, None)
    _same(torch.load(ready.start_params, weights_only=True), want)
    # A stream that no longer reads: no estimate, the workers start from their own.
    stream.path.write_bytes(stream.path.read_bytes()[:-1])
    ready = hand_start(
        by_delta, handoff, NESTEROV, 0, str(path), parameters_vector_hash(theta), {}, 3, stream
    )
    assert (ready.start_params, ready.reason) == ("", "InvalidHandoffData")


def test_a_damaged_state_is_dropped_not_used(tmp_path: Path) -> None:
    job = JobDirectory(tmp_path / "state", "job-a")
    handoff = HandoffDir(tmp_path / "workers")
    job.save_eager({"format": 1, "replica": {"version": 1}})
    ready = _hand(job, handoff, 0, _state(0), 1)
    assert ready.start_params
    saved = job.load_eager()
    assert saved is not None
    assert saved["theta_round"] == 0


# -- hand-off ------------------------------------------------------------------------

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


def test_eager_instructions_cross_the_handoff_and_stand_for_the_serial_round() -> None:
    spec = next_instruction(TRAINED, "/p/round-4.pt", "eager")
    assert spec.start == "eager"
    assert RoundInstruction.from_json(spec.to_json()) == spec
    data = json.loads(spec.to_json())
    del data["start"]
    assert RoundInstruction.from_json(json.dumps(data).encode()).start == "local"
    wanted = replace(spec, base_pending=False, start="local", overlap="delayed")
    assert speculation_unusable(spec, wanted, resync=False) is None
    with pytest.raises(InvalidHandoffData, match="start eager is for a delayed round"):
        replace(TRAINED, start="eager")
    with pytest.raises(InvalidHandoffData, match="start must be local or eager"):
        replace(spec, start="global")


def test_start_markers_and_files_go_with_their_round(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    assert handoff.read_start_ready("job-a", 4) is None
    ready = handoff.write_start("job-a", 4, _state(0), "h" * 64)
    assert handoff.read_start_ready("job-a", 4) == ready
    assert Path(ready.start_params) == handoff.start_params_path("job-a", 4)
    with pytest.raises(InvalidHandoffData, match="go together"):
        StartReady("job-a", 4, start_params="/x.pt")
    handoff.start_ready_path("job-a", 5).write_text('{"job": "job-a"}')
    with pytest.raises(InvalidHandoffData, match="missing fields"):
        handoff.read_start_ready("job-a", 5)
    handoff.prune_rounds("job-a", 6)
    assert handoff.read_start_ready("job-a", 4) is None
    assert not handoff.start_params_path("job-a", 4).exists()


# -- the announcement -------------------------------------------------------------------


def _announce(**extra: object) -> RoundAnnouncement:
    return announcement(
        job="job-a",
        version=2,
        params_hash="a" * 64,
        update_digest="b" * 64,
        round_state=None,
        state="open",
        regions=("eu-west", "us-east"),
        quorum=2,
        inner_steps=5,
        codec=CodecParams(),
        task="tests.support.tiny_task:TinyTask",
        task_options={},
        seed=0,
        training=TrainingConfig(),
        total_rounds=4,
        default_deadline_s=60.0,
        now=1_700_000_000.0,
        overlap="delayed",
        **extra,  # type: ignore[arg-type]
    )


def test_the_announcement_carries_the_outer_config_only_for_eager() -> None:
    eager = _announce(overlap_start="eager", outer_optimizer=NESTEROV)
    parsed = RoundAnnouncement.model_validate_json(eager.model_dump_json())
    assert (parsed.overlap_start, parsed.outer_optimizer) == ("eager", NESTEROV)
    local = _announce(outer_optimizer=NESTEROV)
    assert (local.overlap_start, local.outer_optimizer) == ("local", None)
    # An announcement from a coordinator that predates the fields: a local start.
    data = json.loads(local.model_dump_json())
    del data["overlap_start"], data["outer_optimizer"]
    old = RoundAnnouncement.model_validate_json(json.dumps(data))
    assert (old.overlap_start, old.outer_optimizer) == ("local", None)


# -- the agent's DelayedRounds --------------------------------------------------------


class _Workers:
    def __init__(self, root: Path) -> None:
        self.handoff = HandoffDir(root)


async def test_an_eager_job_hands_s_with_the_next_instruction_and_again_after_a_restart(
    tmp_path: Path,
) -> None:
    job = JobDirectory(tmp_path / "state", "job-a")
    workers = _Workers(tmp_path / "workers")
    rounds = DelayedRounds(cast(Any, workers), "eu-west", 5.0)
    theta = _state(0)
    base = _hold(job, 3, theta)
    trained = replace(TRAINED, base_params=str(base))
    summary = RoundSummary(
        job="job-a",
        round=3,
        steps=5,
        tokens=10,
        mean_loss=1.0,
        cursor=25,
        base_params_hash=parameters_vector_hash(theta),
        params_hash="p" * 64,
        world_size=1,
        train_seconds=1.0,
    )
    result = RoundResult(summary, _state(1))
    eager = announce(
        job="job-a",
        round_=3,
        overlap="delayed",
        total_rounds=5,
        overlap_start="eager",
        outer_optimizer=NESTEROV,
    )
    promised = job.params_path(4)
    # Without the job's outer config (an older coordinator): a local start, no S.
    local = eager.model_copy(update={"outer_optimizer": None})
    await rounds.speculate(local, trained, promised, result=result, job=job)
    assert workers.handoff.read_instruction("job-a", 4).start == "local"
    assert workers.handoff.read_start_ready("job-a", 4) is None
    workers.handoff.instruction_path("job-a", 4).unlink()

    await rounds.speculate(eager, trained, promised, result=result, job=job)
    assert workers.handoff.read_instruction("job-a", 4).start == "eager"
    ready = workers.handoff.read_start_ready("job-a", 4)
    assert ready is not None
    expected = OuterReplica(NESTEROV, steps=3).start(theta, result.params, None, 2)
    _same(torch.load(ready.start_params, weights_only=True), expected)
    # A restart between the instruction and S: the repeated call hands S over.
    workers.handoff.start_ready_path("job-a", 4).unlink()
    job.forget_eager()
    await rounds.speculate(eager, trained, promised, result=result, job=job)
    again = workers.handoff.read_start_ready("job-a", 4)
    assert again is not None
    assert again.start_hash == ready.start_hash
