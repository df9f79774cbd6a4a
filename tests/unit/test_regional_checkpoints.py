"""Regional checkpoints are per job: where they live, parking and restoring a job's state,
removal when the job is forgotten, and the checkpoint of the old one-per-region place."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from regional_agent.handoff import HandoffDir, InvalidHandoffData, RegionalCheckpoint
from regional_agent.job_state import JobState
from tests.unit.test_handoff import INSTRUCTION, PARAMS, SUMMARY

CPU = torch.device("cpu")


def trained_optimizer(steps: int) -> dict[str, object]:
    """The tiny task's AdamW state after ``steps`` steps (a real state dict to restore)."""
    from tests.support.tiny_task import TinyTask

    task = TinyTask()
    model = task.build_model(seed=1)
    optimizer = task.build_optimizer(model.parameters())
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.ones(2, 8)).pow(2).sum().backward()
        optimizer.step()
    return optimizer.state_dict()


def checkpoint(job: str, last_round: int, cursor: int, steps: int = 1) -> RegionalCheckpoint:
    return RegionalCheckpoint(job, last_round, cursor, 2, trained_optimizer(steps))


def test_each_job_has_its_own_checkpoint_beside_its_round_files(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    assert handoff.checkpoint_path("alpha") == tmp_path / "jobs/alpha/regional-checkpoint.pt"
    with pytest.raises(ValueError, match="job"):
        handoff.checkpoint_path("../alpha")  # named as a job directory is: never a path
    handoff.write_checkpoint(checkpoint("alpha", 3, 120, steps=4))
    handoff.write_checkpoint(checkpoint("beta", 0, 40, steps=1))

    alpha, beta = handoff.read_checkpoint("alpha"), handoff.read_checkpoint("beta")
    assert alpha is not None
    assert beta is not None
    assert (alpha.job, alpha.last_round, alpha.cursor) == ("alpha", 3, 120)
    assert (beta.job, beta.last_round, beta.cursor) == ("beta", 0, 40)
    assert alpha.optimizer_state["state"][0]["step"].item() == 4
    assert beta.optimizer_state["state"][0]["step"].item() == 1
    assert handoff.read_checkpoint("gamma") is None
    assert (handoff.has_checkpoint("alpha"), handoff.has_checkpoint("gamma")) == (True, False)
    assert not handoff.legacy_checkpoint_path.exists()


def test_a_checkpoint_holding_another_jobs_state_is_refused(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    handoff.write_checkpoint(checkpoint("beta", 0, 40))
    handoff.checkpoint_path("alpha").parent.mkdir(parents=True)
    handoff.checkpoint_path("beta").rename(handoff.checkpoint_path("alpha"))
    with pytest.raises(InvalidHandoffData, match="holds the state of job 'beta'"):
        handoff.read_checkpoint("alpha")


def test_the_checkpoint_is_no_round_file(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    handoff.write_instruction(INSTRUCTION)
    handoff.write_result(SUMMARY, PARAMS)
    handoff.write_done(SUMMARY)
    handoff.write_checkpoint(checkpoint("job-a", 3, 200))
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
    handoff.write_checkpoint(checkpoint("job-a", 3, 200))
    handoff.write_checkpoint(checkpoint("job-b", 1, 80))

    handoff.forget_job("job-a")
    assert not handoff.has_checkpoint("job-a")
    assert handoff.read_done("job-a", 3) is None
    assert sorted(p.name for p in handoff.job_dir("job-a").iterdir()) == []
    kept = handoff.read_checkpoint("job-b")
    assert kept is not None
    assert kept.last_round == 1
    handoff.forget_job("never-ran")  # nothing to remove is fine


def legacy(handoff: HandoffDir, ckpt: RegionalCheckpoint) -> None:
    """A checkpoint where groups kept the region's single one."""
    body = {"format": 1, **{name: getattr(ckpt, name) for name in ckpt.__dataclass_fields__}}
    torch.save(body, handoff.legacy_checkpoint_path)


def test_a_legacy_checkpoint_moves_to_its_jobs_place_once(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    legacy(handoff, checkpoint("alpha", 2, 90, steps=3))

    assert handoff.migrate_legacy_checkpoint() == "alpha"
    assert not handoff.legacy_checkpoint_path.exists()
    moved = handoff.read_checkpoint("alpha")
    assert moved is not None
    assert (moved.last_round, moved.cursor) == (2, 90)
    assert moved.optimizer_state["state"][0]["step"].item() == 3
    assert handoff.migrate_legacy_checkpoint() is None  # once


def test_a_legacy_checkpoint_never_replaces_the_jobs_own(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    handoff.write_checkpoint(checkpoint("alpha", 5, 200))
    legacy(handoff, checkpoint("alpha", 2, 90))

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
    legacy(handoff, checkpoint("beta", 1, 40))
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
    handoff.write_checkpoint(checkpoint("alpha", 2, 120, steps=6))
    handoff.write_checkpoint(checkpoint("beta", 0, 40, steps=2))

    states = []
    for instruction in (alpha_round, beta_round, alpha_round):
        state = JobState.build(instruction, CPU, handoff.read_checkpoint(instruction.job))
        states.append(state)
    alpha, beta, alpha_again = states
    assert (alpha.job, alpha.last_round, alpha.cursor) == ("alpha", 2, 120)
    assert (beta.job, beta.last_round, beta.cursor) == ("beta", 0, 40)
    assert (alpha_again.last_round, alpha_again.cursor) == (alpha.last_round, alpha.cursor)
    for state, steps in ((alpha, 6), (beta, 2), (alpha_again, 6)):
        assert state.resume_optimizer is not None
        assert state.resume_optimizer["state"][0]["step"].item() == steps

    fresh = JobState.build(replace(INSTRUCTION, job="gamma"), CPU, handoff.read_checkpoint("gamma"))
    assert (fresh.last_round, fresh.cursor, fresh.resume_optimizer) == (None, 0, None)
