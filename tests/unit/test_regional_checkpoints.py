"""Regional checkpoints are per job: where they live, parking and restoring a job's state,
removal when the job is forgotten, the sharded optimizer state a record names, and the
whole-state checkpoints of the format before (per job, and at the old one-per-region place)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from geofed.params import parameters_vector_hash
from geofed.theta_file import write_theta
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.errors import InvalidHandoffData
from regional_agent.handoff.messages import RegionalCheckpoint
from regional_agent.worker.job_state import WorkerJobState, read_base
from regional_agent.worker.optimizer_checkpoint import (
    ShardedCheckpointError,
    load_optimizer,
    read_optimizer_state,
    save_due,
    save_optimizer,
)
from tests.support.handoff_samples import INSTRUCTION, PARAMS, SUMMARY
from tests.support.tiny_task import TinyTask

CPU = torch.device("cpu")


def trained_optimizer(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The tiny task's model and AdamW after ``steps`` steps (a real state to restore)."""
    task = TinyTask()
    model = task.build_model(seed=1)
    optimizer = task.build_optimizer(model.parameters())
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.ones(2, 8)).pow(2).sum().backward()
        optimizer.step()
    return model, optimizer


def checkpoint(
    handoff: HandoffDir, job: str, last_round: int, cursor: int, steps: int = 1
) -> RegionalCheckpoint:
    """Job ``job``'s checkpoint as a group writes it: the optimizer state of ``last_round``
    saved (one process here) and the record naming it."""
    model, optimizer = trained_optimizer(steps)
    save_optimizer(model, optimizer, handoff.optimizer_path(job, last_round))
    written = RegionalCheckpoint(job, last_round, cursor, 2, optimizer_round=last_round)
    handoff.write_checkpoint(written)
    return written


def whole(job: str, last_round: int, cursor: int, steps: int = 1) -> RegionalCheckpoint:
    """A whole-state checkpoint of the format before."""
    _, optimizer = trained_optimizer(steps)
    return RegionalCheckpoint(job, last_round, cursor, 2, optimizer.state_dict())


def steps_of(handoff: HandoffDir, job: str) -> int:
    """The AdamW step count of ``job``'s saved optimizer state (either format)."""
    state = read_optimizer_state(handoff, job)
    assert state is not None
    by_name = state["state"]
    entry = by_name["0.weight"] if "0.weight" in by_name else by_name[0]
    return int(entry["step"].item())


def test_each_job_has_its_own_checkpoint_beside_its_round_files(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    assert handoff.checkpoint_path("alpha") == tmp_path / "jobs/alpha/regional-checkpoint.json"
    assert handoff.optimizer_path("alpha", 3) == tmp_path / "jobs/alpha/optimizer-round-3"
    with pytest.raises(ValueError, match="job"):
        handoff.checkpoint_path("../alpha")  # named as a job directory is: never a path
    checkpoint(handoff, "alpha", 3, 120, steps=4)
    checkpoint(handoff, "beta", 0, 40, steps=1)

    alpha, beta = handoff.read_checkpoint("alpha"), handoff.read_checkpoint("beta")
    assert alpha is not None
    assert beta is not None
    assert (alpha.job, alpha.last_round, alpha.cursor, alpha.optimizer_round) == (
        "alpha",
        3,
        120,
        3,
    )
    assert (beta.job, beta.last_round, beta.cursor) == ("beta", 0, 40)
    assert alpha.optimizer_state is None  # the record holds no tensor
    assert (steps_of(handoff, "alpha"), steps_of(handoff, "beta")) == (4, 1)
    assert handoff.read_checkpoint("gamma") is None
    assert (handoff.has_checkpoint("alpha"), handoff.has_checkpoint("gamma")) == (True, False)
    assert not handoff.legacy_checkpoint_path.exists()


def test_a_record_names_an_older_optimizer_state_or_none(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    checkpoint(handoff, "alpha", 3, 120, steps=4)
    handoff.write_checkpoint(RegionalCheckpoint("alpha", 5, 200, 2, optimizer_round=3))
    later = handoff.read_checkpoint("alpha")
    assert later is not None
    assert (later.last_round, later.cursor, later.optimizer_round) == (5, 200, 3)
    assert steps_of(handoff, "alpha") == 4
    handoff.write_checkpoint(RegionalCheckpoint("beta", 0, 40, 2))
    assert read_optimizer_state(handoff, "beta") is None
    with pytest.raises(InvalidHandoffData, match="optimizer_round 6 is not a round up to"):
        RegionalCheckpoint("alpha", 5, 200, 2, optimizer_round=6)
    with pytest.raises(InvalidHandoffData, match="no longer written"):
        handoff.write_checkpoint(whole("alpha", 6, 240))


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (b"{", "not JSON"),
        (b'{"format": 1}', "not a format-2 regional checkpoint"),
        (
            b'{"format": 2, "job": "alpha", "last_round": -1, "cursor": 0, "world_size": 1,'
            b' "parallelism": "ddp", "optimizer_round": null}',
            "last_round",
        ),
        (b'{"format": 2, "job": "alpha"}', "missing"),
    ],
)
def test_a_malformed_record_is_refused_saying_why(tmp_path: Path, raw: bytes, error: str) -> None:
    handoff = HandoffDir(tmp_path)
    handoff.checkpoint_path("alpha").parent.mkdir(parents=True)
    handoff.checkpoint_path("alpha").write_bytes(raw)
    with pytest.raises(InvalidHandoffData, match=error):
        handoff.read_checkpoint("alpha")


def test_a_checkpoint_holding_another_jobs_state_is_refused(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    checkpoint(handoff, "beta", 0, 40)
    handoff.checkpoint_path("alpha").parent.mkdir(parents=True)
    handoff.checkpoint_path("beta").rename(handoff.checkpoint_path("alpha"))
    with pytest.raises(InvalidHandoffData, match="holds the state of job 'beta'"):
        handoff.read_checkpoint("alpha")


def test_the_checkpoint_is_no_round_file(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    handoff.write_instruction(INSTRUCTION)
    handoff.write_result(SUMMARY, PARAMS)
    handoff.write_done(SUMMARY)
    checkpoint(handoff, "job-a", 3, 200)
    later = replace(INSTRUCTION, round=4)
    handoff.write_instruction(later)
    assert handoff.pending_instruction() == ("job-a", 4)
    assert handoff.prune_rounds("job-a", before_round=5) == 2
    assert handoff.read_checkpoint("job-a") is not None


def test_forgetting_a_job_removes_its_checkpoint_only(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    handoff.write_instruction(INSTRUCTION)
    handoff.write_result(SUMMARY, PARAMS)
    handoff.write_done(SUMMARY)
    checkpoint(handoff, "job-a", 3, 200)
    checkpoint(handoff, "job-b", 1, 80)

    handoff.forget_job("job-a")
    assert not handoff.has_checkpoint("job-a")
    assert handoff.read_done("job-a", 3) is None
    assert sorted(p.name for p in handoff.job_dir("job-a").iterdir()) == []
    kept = handoff.read_checkpoint("job-b")
    assert kept is not None
    assert kept.last_round == 1
    assert steps_of(handoff, "job-b") == 1
    handoff.forget_job("never-ran")  # nothing to remove is fine


def legacy(handoff: HandoffDir, ckpt: RegionalCheckpoint, path: Path | None = None) -> None:
    """A whole-state checkpoint of the format before: by default where groups kept the
    region's single one."""
    fields = ("job", "last_round", "cursor", "world_size", "optimizer_state", "parallelism")
    body = {"format": 1, **{name: getattr(ckpt, name) for name in fields}}
    target = handoff.legacy_checkpoint_path if path is None else path
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save(body, target)


def test_a_legacy_checkpoint_moves_to_its_jobs_place_once(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    legacy(handoff, whole("alpha", 2, 90, steps=3))

    assert handoff.migrate_legacy_checkpoint() == "alpha"
    assert not handoff.legacy_checkpoint_path.exists()
    moved = handoff.read_checkpoint("alpha")
    assert moved is not None
    assert (moved.last_round, moved.cursor) == (2, 90)
    assert steps_of(handoff, "alpha") == 3
    assert handoff.migrate_legacy_checkpoint() is None  # once
    # The job's next record replaces the whole-state file.
    handoff.write_checkpoint(RegionalCheckpoint("alpha", 3, 100, 2))
    assert not handoff.whole_checkpoint_path("alpha").exists()
    assert read_optimizer_state(handoff, "alpha") is None


def test_a_legacy_checkpoint_never_replaces_the_jobs_own(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    checkpoint(handoff, "alpha", 5, 200)
    legacy(handoff, whole("alpha", 2, 90))

    assert handoff.migrate_legacy_checkpoint() == "alpha"
    assert not handoff.legacy_checkpoint_path.exists()
    own = handoff.read_checkpoint("alpha")
    assert own is not None
    assert own.last_round == 5


def test_an_unreadable_legacy_checkpoint_is_left_alone_until_a_job_is_forgotten(
    tmp_path: Path,
) -> None:
    handoff = HandoffDir(tmp_path)
    handoff.legacy_checkpoint_path.write_bytes(b"garbage")
    with pytest.raises(InvalidHandoffData, match="unreadable regional checkpoint"):
        handoff.migrate_legacy_checkpoint()
    assert handoff.legacy_checkpoint_path.exists()
    handoff.forget_job("alpha")
    assert not handoff.legacy_checkpoint_path.exists()


def test_forgetting_a_job_removes_a_legacy_checkpoint_of_that_job_only(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    legacy(handoff, whole("beta", 1, 40))
    handoff.forget_job("alpha")
    assert handoff.legacy_checkpoint_path.exists()
    handoff.forget_job("beta")
    assert not handoff.legacy_checkpoint_path.exists()


def test_switching_jobs_parks_one_and_restores_the_other_from_its_own_checkpoint(
    tmp_path: Path,
) -> None:
    """The worker's switch: a job's state is rebuilt from its own checkpoint, whatever the
    group trained in between; a job with none starts afresh."""
    handoff = HandoffDir(tmp_path)
    alpha_round = replace(INSTRUCTION, job="alpha", round=3)
    beta_round = replace(INSTRUCTION, job="beta", round=1, seed=9)
    checkpoint(handoff, "alpha", 2, 120, steps=6)
    handoff.write_checkpoint(RegionalCheckpoint("alpha", 4, 200, 2, optimizer_round=2))
    legacy(handoff, whole("beta", 0, 40, steps=2), handoff.whole_checkpoint_path("beta"))
    path = handoff.optimizer_path

    states = []
    for instruction in (alpha_round, beta_round, alpha_round):
        state = WorkerJobState.build(
            instruction, CPU, handoff.read_checkpoint(instruction.job), path
        )
        states.append(state)
    alpha, beta, alpha_again = states
    assert (alpha.job, alpha.last_round, alpha.cursor) == ("alpha", 4, 200)
    assert (beta.job, beta.last_round, beta.cursor) == ("beta", 0, 40)
    assert (alpha_again.last_round, alpha_again.cursor) == (alpha.last_round, alpha.cursor)
    for state in (alpha, alpha_again):
        # The record's cursor and round, the optimizer state of the round it names.
        assert (state.resume_optimizer, state.saved_optimizer_round) == (None, 2)
        assert state.resume_optimizer_path == handoff.optimizer_path("alpha", 2)
    assert beta.resume_optimizer is not None
    assert beta.resume_optimizer["state"][0]["step"].item() == 2
    assert beta.resume_optimizer_path is None

    gamma = replace(INSTRUCTION, job="gamma")
    fresh = WorkerJobState.build(gamma, CPU, handoff.read_checkpoint("gamma"), path)
    assert (fresh.last_round, fresh.cursor, fresh.resume_optimizer) == (None, 0, None)
    assert (fresh.resume_optimizer_path, fresh.saved_optimizer_round) == (None, None)


def test_the_optimizer_state_is_saved_first_then_every_few_rounds() -> None:
    first = save_due(0, None, every=4)
    assert first.save
    assert first.reason == "no inner optimizer state is saved yet"
    assert [save_due(r, 0, every=4).save for r in range(1, 6)] == [False, False, False, True, True]
    assert save_due(2, 0, every=4).reason == "2 of 4 rounds since the last save"
    assert save_due(7, 3, every=4).reason == "4 rounds since the last save (every 4)"
    assert all(save_due(r, r - 1, every=1).save for r in range(1, 4))
    # The cadence's saves leave the residual out: it would serve a crash in one round.
    assert not first.residual
    assert not any(save_due(r, 0, every=4).residual for r in range(1, 6))


def test_an_asked_checkpoint_is_saved_at_once_and_once() -> None:
    """The coordinator's ask (a hardware risk) from round 5: saved at the first round
    from 5 on, whatever the cadence; once a state of round 5 or later is saved, not again."""
    asked = save_due(5, 3, every=10, asked=5)
    assert (asked.save, asked.reason, asked.residual) == (
        True,
        "asked for from round 5 (the region's hardware risk)",
        True,  # a crash is likely: the residual is written with it
    )
    assert save_due(7, 3, every=10, asked=5).save, "a round finished after the ask"
    assert not save_due(4, 3, every=10, asked=5).save, "not before the round asked"
    assert not save_due(6, 5, every=10, asked=5).save, "honoured already"
    assert not save_due(4, 0, every=4, asked=0).residual, "asked for round 0, saved at 0"
    first = save_due(0, None, every=10, asked=0)
    assert (first.reason, first.residual) == ("no inner optimizer state is saved yet", True)


def test_the_ask_is_a_file_of_the_job_an_unreadable_one_is_none(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    assert handoff.checkpoint_asked("alpha") is None
    handoff.ask_checkpoint("alpha", 3)
    assert (handoff.checkpoint_asked("alpha"), handoff.checkpoint_asked("beta")) == (3, None)
    (handoff.job_dir("alpha") / "checkpoint-asked").write_text("three\n")
    assert handoff.checkpoint_asked("alpha") is None
    handoff.ask_checkpoint("alpha", 4)
    handoff.forget_job("alpha")
    assert handoff.checkpoint_asked("alpha") is None


def test_only_the_named_optimizer_states_are_kept(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    for round_ in (1, 3, 5):
        checkpoint(handoff, "alpha", round_, 10 * round_)
    checkpoint(handoff, "beta", 2, 20)
    handoff.remove_optimizer_states("alpha", (3, None))
    assert sorted(p.name for p in handoff.job_dir("alpha").glob("optimizer-*")) == [
        "optimizer-round-3"
    ]
    assert handoff.optimizer_path("beta", 2).is_dir()  # another job's are its own


def test_a_missing_or_torn_optimizer_state_fails_as_an_error_saying_where(tmp_path: Path) -> None:
    """DCP's own failure is a BaseException; it arrives as an ordinary, named error."""
    model, optimizer = trained_optimizer(1)
    missing = tmp_path / "optimizer-round-3"
    with pytest.raises(ShardedCheckpointError, match=f"cannot load {missing}: rank 0: "):
        load_optimizer(model, optimizer, missing)
    save_optimizer(model, optimizer, missing)
    (missing / ".metadata").write_bytes(b"torn")
    with pytest.raises(ShardedCheckpointError, match="cannot load"):
        load_optimizer(model, optimizer, missing)


def test_a_rounds_base_is_hashed_from_its_file_and_its_tensors_read_when_asked(
    tmp_path: Path,
) -> None:
    """Rank 0's base θ: its tensors read one at a time, in the hash's order, hashed as
    they are read (a load hashes θ), to the file's hash; a torch.save-d state (the format
    before) hashes the same."""
    model = TinyTask().build_model(seed=1)
    state = {name: t.detach().float() for name, t in model.state_dict().items()}
    digest = write_theta(tmp_path / "theta.safetensors", state)
    base = read_base(model, str(tmp_path / "theta.safetensors"))
    assert list(base.state) == sorted(state)
    assert all(torch.equal(base.state[name], state[name]) for name in base.state)
    assert base.hash == digest == parameters_vector_hash(state)
    torch.save(state, tmp_path / "theta.pt")
    assert read_base(model, str(tmp_path / "theta.pt")).hash == digest
