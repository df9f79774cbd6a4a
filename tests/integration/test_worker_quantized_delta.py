"""Rank 0 hands over the round's delta quantized, with its error feedback (2 gloo ranks,
real processes): the bytes equal what the agent's own encoding of the trained parameters
gives, round after round, with the residual the agent holds, whichever way it got there.

Two jobs with the same seed and data train the same parameters: ``plain`` hands over its
parameters, ``quantized`` its delta; the agent's side is played by the test (it keeps
``feedback.pt`` as the agent's state directory does).
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from geofed.codec import ErrorFeedback
from geofed.codec_params import CodecParams
from geofed.params import parameters_vector_hash
from geofed.training_config import TrainingConfig
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.messages import DeltaRequest, RoundResult
from regional_agent.handoff.residual_file import Residual, read_residual, write_residual
from regional_agent.launch.launcher import LocalElasticLauncher
from regional_agent.launch.worker_group import RoundFailed, WorkerGroup, WorkerGroupConfig
from regional_agent.rounds.delta import encode_delta
from tests.support.global_updates import chained_theta
from tests.support.pki import make_federation
from tests.support.tiny_task import TinyTask
from tests.support.worker_group import instruction, launcher_config, save_state

pytestmark = pytest.mark.integration
on_module_loop = pytest.mark.asyncio(loop_scope="module")

STEPS = 4
# Small chunks and blocks: the tiny model's tensors span several chunks, with tails.
CODEC = CodecParams(scheme="int8", block_size=16)
CHUNK = 64
DDP = TrainingConfig()
FSDP = TrainingConfig(parallelism="fsdp")


@dataclass
class Region:
    workdir: Path
    handoff: HandoffDir
    group: WorkerGroup
    feedback: Path  # the agent's residual after its last accepted delta

    async def plain(
        self, round_: int, base: Path, training: TrainingConfig = DDP, job: str = "plain"
    ) -> RoundResult:
        step = instruction(job, round_, base, inner_steps=STEPS, training=training)
        return await self.group.run_round(step, 60)

    async def quantized(
        self,
        round_: int,
        base: Path,
        training: TrainingConfig = DDP,
        job: str = "quantized",
        *,
        written: bool = True,
    ) -> RoundResult:
        """A round handing over its quantized delta; ``written``: with a checkpoint asked
        for, so that the workers write the residual's tensors (for the test to compare)
        instead of a held residual file."""
        if written:
            self.handoff.ask_checkpoint(job, round_)
        request = DeltaRequest(CODEC, str(self.feedback), CHUNK)
        step = instruction(job, round_, base, inner_steps=STEPS, training=training, delta=request)
        return await self.group.run_round(step, 60)

    def accept(self, result: RoundResult) -> None:
        """What the agent does once the coordinator took the delta: keep its residual."""
        assert result.residual is not None
        spooled = self.workdir / "spooled-residual.pt"
        self.feedback.parent.mkdir(exist_ok=True)
        os.link(result.residual, spooled)
        spooled.replace(self.feedback)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def region(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Region]:
    workdir = tmp_path_factory.mktemp("quantizing-region")
    launcher = LocalElasticLauncher(workdir, launcher_config())
    group = WorkerGroup(workdir, launcher, WorkerGroupConfig(start_timeout_s=120.0))
    await group.start()
    yield Region(workdir, HandoffDir(workdir), group, workdir / "agent" / "feedback.pt")
    await group.stop()


def agent_encoding(
    base: Path, trained: dict[str, torch.Tensor], residual: dict[str, torch.Tensor] | None
) -> tuple[bytes, dict[str, torch.Tensor]]:
    """The agent's own encoding of ``trained`` against θ at ``base``: bytes and residual."""
    feedback = ErrorFeedback()
    if residual is not None:
        feedback.load_state_dict({"version": 1, "residual": residual})
    theta = torch.load(base, weights_only=True)
    encoded = encode_delta(theta, trained, feedback, CODEC, chunk_elements=CHUNK)
    return encoded.stream.to_bytes(), encoded.feedback.residual


def worker_encoding(result: RoundResult) -> tuple[bytes, dict[str, torch.Tensor]]:
    assert result.delta is not None
    assert result.residual is not None
    assert result.params == {}
    residual = read_residual(result.residual)
    assert isinstance(residual, Residual)
    assert residual.round == result.summary.round
    return result.delta.to_bytes(), dict(residual.tensors)


def assert_same(
    got: tuple[bytes, dict[str, torch.Tensor]], want: tuple[bytes, dict[str, torch.Tensor]]
) -> None:
    assert got[0] == want[0]
    assert got[1].keys() == want[1].keys()
    for name, tensor in want[1].items():
        assert torch.equal(got[1][name], tensor), name


@on_module_loop
async def test_the_workers_delta_is_the_agents_encoding_round_after_round(
    region: Region,
) -> None:
    base = save_state(region.workdir / "theta0.pt", TinyTask().build_model(seed=3).state_dict())
    residual: dict[str, torch.Tensor] | None = None
    for round_ in range(3):
        plain = await region.plain(round_, base)
        quantized = await region.quantized(round_, base)
        want = agent_encoding(base, plain.params, residual)
        assert_same(worker_encoding(quantized), want)
        assert any(t.abs().sum() > 0 for t in want[1].values())  # the residual is carried
        region.accept(quantized)  # from round 1 on, rank 0 reuses the residual it kept
        residual = want[1]
        base = save_state(region.workdir / f"theta{round_ + 1}.pt", plain.params)
    # The agent discards its regional state (a rollback, a resync): no residual.
    region.feedback.unlink()
    plain = await region.plain(3, base)
    quantized = await region.quantized(3, base)
    assert_same(worker_encoding(quantized), agent_encoding(base, plain.params, None))

    # The agent's residual is another than the one rank 0 kept (same round, other id).
    other = {name: torch.full_like(t, 1e-3) for name, t in plain.params.items()}
    write_residual(region.feedback, 3, other)
    base = save_state(region.workdir / "theta4.pt", plain.params)
    plain = await region.plain(4, base)
    quantized = await region.quantized(4, base)
    assert_same(worker_encoding(quantized), agent_encoding(base, plain.params, other))

    # A residual of another model is dropped, as the agent's error feedback would.
    misfit = {name: torch.zeros(3) for name in plain.params}
    write_residual(region.feedback, 4, misfit)
    base = save_state(region.workdir / "theta5.pt", plain.params)
    plain = await region.plain(5, base)
    quantized = await region.quantized(5, base)
    assert_same(worker_encoding(quantized), agent_encoding(base, plain.params, None))
    assert "does not fit the model" in region.handoff.rank_log_path(0).read_text()


@on_module_loop
@pytest.mark.parametrize("training", [DDP, FSDP], ids=["ddp", "fsdp"])
async def test_the_next_round_makes_theta_from_the_theta_held_and_the_update(
    region: Region, tmp_path: Path, training: TrainingConfig
) -> None:
    """A serial round's hand-over leaves θ_0 in the model; round 1's θ is θ_0 plus round
    0's update, made on the ranks (no θ read): the round hands over the very delta a
    group that reads θ_1 whole hands over, from the same θ by its hash."""
    kind = training.parallelism
    theta0 = TinyTask().build_model(seed=9).state_dict()
    chain, _, after = chained_theta(make_federation(tmp_path / "fed"), theta0, tmp_path, job="a")
    request = DeltaRequest(CODEC, str(tmp_path / "no-feedback.pt"), CHUNK)
    made = "θ_1 made from the shards' θ_0 and its update"
    before = region.handoff.rank_log_path(0).read_text().count(made)
    results = {}
    for job, hashed in ((f"held-{kind}", True), (f"whole-{kind}", False)):
        first = instruction(
            job,
            0,
            tmp_path / "theta-0.st",
            inner_steps=STEPS,
            training=training,
            delta=request,
            base_hash=parameters_vector_hash(theta0),
        )
        await region.group.run_round(first, 60)
        step = instruction(
            job,
            1,
            chain,
            inner_steps=STEPS,
            training=training,
            delta=request,
            base_hash=parameters_vector_hash(after) if hashed else None,
        )
        results[job] = await region.group.run_round(step, 60)
    held, whole = results[f"held-{kind}"], results[f"whole-{kind}"]
    # Once: the round without the hash read θ_1 whole.
    assert region.handoff.rank_log_path(0).read_text().count(made) == before + 1
    assert held.summary.base_params_hash == parameters_vector_hash(after)
    assert whole.summary.base_params_hash == parameters_vector_hash(after)  # read and hashed
    assert held.delta is not None
    assert whole.delta is not None
    assert held.delta.to_bytes() == whole.delta.to_bytes()


@on_module_loop
async def test_under_fsdp_rank_zero_quantizes_the_gathered_parameters(region: Region) -> None:
    region.feedback.unlink(missing_ok=True)
    base = save_state(region.workdir / "theta-f0.pt", TinyTask().build_model(seed=5).state_dict())
    residual: dict[str, torch.Tensor] | None = None
    for round_ in range(2):
        plain = await region.plain(round_, base, FSDP, "plain-fsdp")
        quantized = await region.quantized(round_, base, FSDP, "quantized-fsdp")
        want = agent_encoding(base, plain.params, residual)
        assert_same(worker_encoding(quantized), want)
        region.accept(quantized)
        residual = want[1]
        base = save_state(region.workdir / f"theta-f{round_ + 1}.pt", plain.params)
    region.feedback.unlink()


@on_module_loop
async def test_an_unreadable_residual_fails_the_round_and_changes_nothing(
    region: Region,
) -> None:
    base = save_state(region.workdir / "theta-10.pt", TinyTask().build_model(seed=3).state_dict())
    first = await region.quantized(10, base)
    region.accept(first)
    kept = region.feedback.read_bytes()
    region.feedback.write_bytes(b"not a residual")
    with pytest.raises(RoundFailed, match="cannot hand over the delta: ResidualFileError"):
        await region.quantized(11, base)
    assert not region.handoff.residual_path("quantized", 11).exists()
    assert region.feedback.read_bytes() == b"not a residual"
    # The agent's residual is back: the round trains again, from the last checkpoint.
    region.feedback.write_bytes(kept)
    again = await region.quantized(11, base)
    assert again.delta is not None
    assert again.summary.cursor == first.summary.cursor + STEPS


@on_module_loop
async def test_under_fsdp_a_failed_quantization_leaves_no_rank_waiting(region: Region) -> None:
    """Rank 0 quantizes as the ranks gather tensor by tensor: when it cannot, every rank
    still gathers the rest, the round fails on all of them, and it trains again."""
    region.feedback.unlink(missing_ok=True)
    base = save_state(region.workdir / "theta-g0.pt", TinyTask().build_model(seed=3).state_dict())
    first = await region.quantized(0, base, FSDP, "gathered")
    region.accept(first)
    kept = region.feedback.read_bytes()
    region.feedback.write_bytes(b"not a residual")
    with pytest.raises(RoundFailed, match="cannot hand over the delta: ResidualFileError"):
        await region.quantized(1, base, FSDP, "gathered")
    assert not region.handoff.residual_path("gathered", 1).exists()
    region.feedback.write_bytes(kept)
    again = await region.quantized(1, base, FSDP, "gathered")
    assert again.delta is not None
    assert again.summary.cursor == first.summary.cursor + STEPS
    log = region.handoff.rank_log_path(0).read_text()
    assert "job gathered round 1: delta quantized on cpu, tensor by tensor" in log
    region.feedback.unlink()


@on_module_loop
async def test_between_checkpoints_rank_zero_holds_the_residual(tmp_path: Path) -> None:
    """``regional_checkpoint_every: 3``: a round writes a held residual file, not the
    tensors, unless it saves a checkpoint the agent asked for, and its delta is still the
    agent's own encoding with the residual the agent holds; a stopped group writes rank
    0's copy out and the next group reads it; a delta the coordinator did not take costs
    the residual. A checkpoint the agent asks for (the coordinator's hardware-risk ask)
    is saved at once, once."""

    def new_group() -> WorkerGroup:
        launcher = LocalElasticLauncher(tmp_path, launcher_config(regional_checkpoint_every=3))
        return WorkerGroup(tmp_path, launcher, WorkerGroupConfig(start_timeout_s=120.0))

    region = Region(tmp_path, HandoffDir(tmp_path), new_group(), tmp_path / "agent" / "feedback.pt")
    base = save_state(tmp_path / "theta0.pt", TinyTask().build_model(seed=4).state_dict())
    residual: dict[str, torch.Tensor] | None = None
    kinds = []

    async def round_(number: int, accepted: bool = True) -> None:
        nonlocal base, residual
        # The quantized job first: the plain one parks it only after its delta is out.
        quantized = await region.quantized(number, base, job="sparse", written=False)
        plain = await region.plain(number, base, job="sparse-plain")
        want = agent_encoding(base, plain.params, residual)
        assert quantized.delta is not None
        assert quantized.residual is not None
        assert quantized.delta.to_bytes() == want[0]
        kinds.append(type(read_residual(quantized.residual)).__name__)
        if accepted:
            region.accept(quantized)
            residual = want[1]
        base = save_state(tmp_path / f"theta{number + 1}.pt", plain.params)

    await region.group.start()
    try:
        for number in range(3):
            if number == 2:
                region.handoff.ask_checkpoint("sparse", 2)
            await round_(number)
    finally:
        await region.group.stop()
    region.group = new_group()  # rank 0 reads the residual the old group wrote out
    await region.group.start()
    try:
        await round_(3)
        await round_(4, accepted=False)
        residual = None  # the agent's file names round 3's residual: rank 0 has round 4's
        await round_(5)
    finally:
        await region.group.stop()
    # Round 0 saves the first checkpoint (its residual held); after that each round parks
    # the job (the plain one runs between), which saves its optimizer state, so no round
    # is due one again but round 2, asked for, which writes the residual too; the ask,
    # still there, is honoured once.
    assert kinds == ["HeldResidual", "HeldResidual", "Residual"] + ["HeldResidual"] * 3
    log = region.handoff.rank_log_path(0).read_text()
    assert re.search(
        r"job sparse: inner optimizer state of round 2 saved in [0-9.]+ s "
        r"\(asked for from round 2 \(the region's hardware risk\)\)",
        log,
    ), log
    assert "wrote out the residual of round" in log
    assert log.count("starting it anew") == 1
    assert "the error-feedback residual of round 3 was held by the workers only" in log
