"""The agent's durable regional state: θ files, spooled deltas, the residual's promotion."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

from geofed.codec import ErrorFeedback, decode
from geofed.codec_params import CodecParams
from geofed.params import parameters_vector_hash, state_to_fp32
from geofed.theta_chain import ThetaChain, map_params
from geofed.training_config import LrSchedule, TrainingConfig
from geofed.types import ArtifactKind
from regional_agent.credentials import Credentials
from regional_agent.rounds.delta import (
    DeltaOrigin,
    delta_manifest,
    encode_delta,
    sign_delta,
)
from regional_agent.state import AgentState, DeltaMeta, JobDirectory, ParamsVersion, StateError
from tests.support.agent_credentials import agent_credentials
from tests.support.pki import Principal, make_federation
from tests.support.tiny_task import TinyTask

JOB = "tiny"
TRAINING = TrainingConfig(
    precision="bf16", lr_schedule=LrSchedule(kind="warmup_cosine", warmup_steps=4)
)
Params = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def region(tmp_path_factory: pytest.TempPathFactory) -> tuple[Principal, Credentials]:
    fed = make_federation(tmp_path_factory.mktemp("pki"))
    principal = fed.region("eu-west")
    credentials = agent_credentials(fed, principal)
    return principal, credentials


def theta(seed: int) -> Params:
    return state_to_fp32(TinyTask().build_model(seed=seed))


def spool_round(
    state: JobDirectory, credentials: Credentials, round_: int, feedback: ErrorFeedback
) -> ErrorFeedback:
    """Encode, sign and spool a delta of ``round_``; return the residual it leaves."""
    base = theta(1)
    local = {n: t + 0.003 * (round_ + 1) * torch.randn(t.shape) for n, t in base.items()}
    encoded = encode_delta(base, local, feedback, CodecParams(scheme="int4", block_size=16))
    origin = DeltaOrigin(
        job=JOB,
        round=round_,
        base_round=round_,
        base_hash=parameters_vector_hash(base),
        tokens=32,
        producer=credentials.identity,
        jurisdiction="EU",
        datasets=("eu-parliament-proceedings",),
        training=TRAINING,
    )
    signed = sign_delta(delta_manifest(origin, encoded.stream, now=datetime.now(UTC)), credentials)
    meta = DeltaMeta(train_loss=1.25, tokens=32, params_hash=origin.base_hash)
    state.write_spool(round_, signed.to_bytes(), encoded.frames, encoded.feedback, meta)
    return encoded.feedback


def assert_residuals_equal(left: ErrorFeedback, right: ErrorFeedback) -> None:
    assert left.residual.keys() == right.residual.keys()
    for name, tensor in left.residual.items():
        assert torch.equal(tensor, right.residual[name]), name


def test_params_round_trip_and_older_files_are_pruned(tmp_path: Path) -> None:
    state = AgentState(tmp_path).job(JOB)
    assert state.load_params() is None
    for round_ in range(4):
        params = theta(round_)
        state.save_params(ParamsVersion(round_, parameters_vector_hash(params)), params)
    held = state.load_params()
    assert held is not None
    assert held.version == ParamsVersion(3, parameters_vector_hash(theta(3)))
    held_params = map_params(held.path)
    assert list(held_params) == list(theta(3))  # θ's own order survives the file
    assert all(torch.equal(held_params[n], theta(3)[n]) for n in held_params)
    files = sorted(p.name for p in (tmp_path / "jobs" / JOB / "params").glob("round-*"))
    # the current one and one before it, each a θ file and the chain naming it alone
    assert files == [
        "round-2.chain.json",
        "round-2.safetensors",
        "round-3.chain.json",
        "round-3.safetensors",
    ]


def test_damaged_params_are_dropped_so_the_next_sync_resyncs(tmp_path: Path) -> None:
    state = AgentState(tmp_path).job(JOB)
    params = theta(0)
    state.save_params(ParamsVersion(0, parameters_vector_hash(params)), params)
    path = state.params_path(0)
    flip_last_bit(path)
    later = path.stat().st_mtime_ns + 10**9  # a second later, whatever the clock's grain
    os.utime(path, ns=(later, later))
    assert state.load_params() is None
    assert state.current_version() is None


def flip_last_bit(path: Path) -> None:
    with open(path, "r+b") as f:  # one bit of the last tensor flips on disk
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))


def test_an_untouched_held_theta_is_not_read_again(tmp_path: Path) -> None:
    state = AgentState(tmp_path).job(JOB)
    params = theta(0)
    version = ParamsVersion(0, parameters_vector_hash(params))
    state.save_params(version, params)
    path = state.params_path(0)
    recorded = path.stat()
    # Bytes changed behind the file's back, its size, mtime and inode as recorded: taken as
    # it was hashed when it was made the one held (rank 0 hashes what it trains from).
    flip_last_bit(path)
    os.utime(path, ns=(recorded.st_atime_ns, recorded.st_mtime_ns))
    held = state.load_params()
    assert held is not None
    assert held.version == version


def test_a_theta_file_held_before_theta_chains_is_held_as_a_chain_of_itself(
    tmp_path: Path,
) -> None:
    """An agent that wrote θ files only held θ_3 as round-3.safetensors: it still holds it."""
    state = AgentState(tmp_path).job(JOB)
    version = ParamsVersion(3, parameters_vector_hash(theta(3)))
    state.save_params(version, theta(3))
    state.held_path(3).unlink()  # what the agent before left: the θ file and current.json
    held = state.load_params()
    assert held is not None
    assert (held.version, held.path) == (version, state.held_path(3))
    chain = ThetaChain.load(held.path)
    assert (chain.base, chain.base_round, chain.updates) == (state.params_path(3), 3, ())
    assert all(torch.equal(t, theta(3)[n]) for n, t in map_params(held.path).items())


def test_params_of_the_format_before_are_dropped_and_pruned(tmp_path: Path) -> None:
    state = AgentState(tmp_path).job(JOB)
    params = theta(0)
    version = ParamsVersion(0, parameters_vector_hash(params))
    state.save_params(version, params)
    legacy = tmp_path / "jobs" / JOB / "params" / "round-0.pt"
    torch.save(params, legacy)  # what an agent of the format before held
    state.params_path(0).unlink()
    assert state.load_params() is None  # resync, rather than read a file it cannot patch
    state.save_params(ParamsVersion(1, parameters_vector_hash(theta(1))), theta(1))
    state.save_params(ParamsVersion(2, parameters_vector_hash(theta(2))), theta(2))
    assert not legacy.exists()


def test_a_spooled_delta_reads_back_frame_by_frame(
    tmp_path: Path, region: tuple[Principal, Credentials]
) -> None:
    state = AgentState(tmp_path).job(JOB)
    spool_round(state, region[1], 3, ErrorFeedback())
    spooled = state.read_spool(3)
    assert spooled is not None
    manifest = spooled.manifest.manifest
    assert manifest.kind is ArtifactKind.MODEL_DELTA
    assert (manifest.job, manifest.round, manifest.tokens) == (JOB, 3, 32)
    assert manifest.training == TRAINING  # what trained it, under the region's signature
    assert spooled.manifest.verify(region[1].bundle, now=datetime.now(UTC)) == region[1].identity
    frames = [spooled.read_frame(i) for i in range(spooled.frame_count)]
    assert [len(f) for f in frames] == [record.size for record in manifest.chunks]
    decoded = decode(frames)
    assert set(decoded) == set(theta(0))
    assert spooled.meta.train_loss == 1.25
    assert state.spooled_rounds() == [3]
    with pytest.raises(StateError, match="has no frame 99"):
        spooled.read_frame(99)


def test_a_spool_without_its_manifest_does_not_exist(
    tmp_path: Path, region: tuple[Principal, Credentials]
) -> None:
    state = AgentState(tmp_path).job(JOB)
    spool_round(state, region[1], 2, ErrorFeedback())
    (state.spool_dir(2) / "manifest.json").unlink()  # a crash before the last write
    assert state.read_spool(2) is None
    spool_round(state, region[1], 2, ErrorFeedback())  # written again over the remains
    assert state.read_spool(2) is not None


def test_the_residual_advances_only_when_the_delta_is_accepted(
    tmp_path: Path, region: tuple[Principal, Credentials]
) -> None:
    state = AgentState(tmp_path).job(JOB)
    first = spool_round(state, region[1], 0, state.load_feedback())
    assert state.load_feedback().residual == {}  # spooled, not yet accepted
    state.promote(0)
    assert state.uploaded_round() == 0
    assert state.spooled_rounds() == []
    assert_residuals_equal(state.load_feedback(), first)
    # A straggler's delta is dropped and leaves the residual as it was.
    spool_round(state, region[1], 1, state.load_feedback())
    state.discard_spool(1)
    assert_residuals_equal(state.load_feedback(), first)
    assert state.uploaded_round() == 0
    second = spool_round(state, region[1], 2, state.load_feedback())
    state.promote(2)
    state.promote(2)  # idempotent
    assert_residuals_equal(state.load_feedback(), second)
    assert state.uploaded_round() == 2


def test_recover_finishes_a_promotion_a_crash_interrupted(
    tmp_path: Path, region: tuple[Principal, Credentials]
) -> None:
    state = AgentState(tmp_path).job(JOB)
    spool_round(state, region[1], 4, ErrorFeedback())
    old = spool_round(state, region[1], 3, ErrorFeedback())
    residual = spool_round(state, region[1], 5, ErrorFeedback())
    # The crash came right after the progress record of round 5 was written.
    (state.root / "progress.json").write_text('{"format": 1, "uploaded_round": 5}')
    state.recover()
    assert state.spooled_rounds() == []
    assert_residuals_equal(state.load_feedback(), residual)
    assert not torch.equal(
        next(iter(old.residual.values())), next(iter(residual.residual.values()))
    )


def test_downloads_an_unfinished_sync_left_are_removed_when_the_next_begins(
    tmp_path: Path,
) -> None:
    state = AgentState(tmp_path).job(JOB)
    state.prepare_params()
    left = state.download_path("update-3.bundle")
    left.write_bytes(b"part of an update")
    assert left.parent == tmp_path / "jobs" / JOB / "downloads"
    state.prepare_params()
    assert not left.exists()
    assert (left.parent.stat().st_mode & 0o777) == 0o700
    with pytest.raises(StateError, match="a file name"):
        state.download_path("../params/round-3.safetensors")
