"""A round's inner checkpoint: whether it resumes a round (and why not), and its file."""

from __future__ import annotations

import stat
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.messages import RoundInstruction
from regional_agent.worker.inner_checkpoint import (
    InnerCheckpoint,
    InvalidInnerCheckpoint,
    RankInner,
    RoundIdentity,
    discard_inner_checkpoint,
    instruction_digest,
    load_inner_tensors,
    read_inner_checkpoint,
    resume_verdict,
    save_inner_tensors,
    write_inner_checkpoint,
)
from regional_agent.worker.inner_loop import RankTotals

IDENTITY = RoundIdentity(
    job="llm",
    round=3,
    base_hash="a" * 64,
    instruction="d" * 64,
    world_size=2,
    after_round=2,
    start_cursor=300,
)


def instruction(**overrides: object) -> RoundInstruction:
    fields: dict[str, object] = {
        "job": "llm",
        "round": 3,
        "base_params": "/state/theta-3.pt",
        "inner_steps": 100,
        "task": "tests.support.tiny_task:TinyTask",
        "task_options": {"hidden": 8},
        "seed": 7,
        "region": "eu-west",
        "region_index": 0,
        "num_regions": 2,
    }
    fields.update(overrides)
    return RoundInstruction(**fields)  # type: ignore[arg-type]


# (case, the saved identity, its step, words in the reason)
DISCARDED = [
    ("other round", replace(IDENTITY, round=2), 40, "it is of job llm round 2"),
    ("other job", replace(IDENTITY, job="other"), 40, "it is of job other round 3"),
    ("other θ", replace(IDENTITY, base_hash="b" * 64), 40, "trained from θ bbbbbbbbbbbb"),
    ("other instruction", replace(IDENTITY, instruction="e" * 64), 40, "instruction changed"),
    ("other group size", replace(IDENTITY, world_size=4), 40, "taken by 4 ranks, not 2"),
    ("other regional state", replace(IDENTITY, start_cursor=200), 40, "at data step 200"),
    ("rolled back state", replace(IDENTITY, after_round=None), 40, "follows round None"),
    ("step 0", IDENTITY, 0, "step 0 is not within"),
    ("past the end", IDENTITY, 100, "step 100 is not within"),
]


@pytest.mark.parametrize(
    ("case", "saved", "step", "words"), DISCARDED, ids=[c[0] for c in DISCARDED]
)
def test_a_checkpoint_of_anything_but_this_round_is_discarded_with_the_reason(
    case: str, saved: RoundIdentity, step: int, words: str
) -> None:
    verdict = resume_verdict(saved, step, 100, IDENTITY)
    assert verdict.step is None, case
    assert verdict.reason.startswith("job llm round 3: discarding the inner checkpoint: ")
    assert words in verdict.reason, verdict.reason


def test_the_same_round_resumes_at_its_step() -> None:
    verdict = resume_verdict(IDENTITY, 40, 100, replace(IDENTITY))
    assert verdict.step == 40
    assert verdict.reason == "job llm round 3: resuming at step 40 of 100 from the inner checkpoint"


def test_the_instruction_digest_ignores_where_theta_is_and_its_evaluation_only() -> None:
    digest = instruction_digest(instruction())
    assert instruction_digest(instruction(base_params="/elsewhere/theta.pt")) == digest
    assert instruction_digest(instruction(evaluate_base=True)) == digest
    for changed in (
        {"seed": 8},
        {"inner_steps": 99},
        {"region_index": 1},
        {"task_options": {"hidden": 9}},
        {"round": 4},
    ):
        assert instruction_digest(instruction(**changed)) != digest, changed


def checkpoint() -> InnerCheckpoint:
    totals = RankTotals(
        micro_batches=40,
        tokens=160,
        loss_sum=12.345678901234567,
        last_lr=1e-3,
        last_grad_norm=float("nan"),
        seconds=4.5,
        data_wait_seconds=0.25,
    )
    return InnerCheckpoint(
        identity=IDENTITY,
        step=40,
        inner_steps=100,
        ranks=(
            RankInner(torch.get_rng_state(), None, totals),
            RankInner(torch.get_rng_state(), None, replace(totals, tokens=161)),
        ),
    )


def test_the_file_round_trips_exactly_and_is_owner_only(tmp_path: Path) -> None:
    path = HandoffDir(tmp_path).inner_checkpoint_path("llm")
    written = checkpoint()
    write_inner_checkpoint(path, written)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    read = read_inner_checkpoint(path)
    assert read is not None
    assert (read.identity, read.step, read.inner_steps) == (IDENTITY, 40, 100)
    assert [r.totals.tokens for r in read.ranks] == [160, 161]
    assert read.ranks[0].totals.loss_sum == 12.345678901234567
    assert torch.equal(read.ranks[1].cpu_rng, written.ranks[1].cpu_rng)
    assert read_inner_checkpoint(tmp_path / "none.pt") is None


def test_a_corrupt_or_malformed_file_is_refused_with_its_path(tmp_path: Path) -> None:
    path = tmp_path / "inner-checkpoint.pt"
    path.write_bytes(b"not a torch file")
    with pytest.raises(InvalidInnerCheckpoint, match="unreadable"):
        read_inner_checkpoint(path)
    written = checkpoint()
    write_inner_checkpoint(path, replace(written, ranks=written.ranks[:1]))
    with pytest.raises(InvalidInnerCheckpoint, match="1 ranks' states for a group of 2"):
        read_inner_checkpoint(path)
    # A file of the format before (the whole tensors inside) is not resumed from.
    torch.save({"format": 1, "params": {}}, path)
    with pytest.raises(InvalidInnerCheckpoint, match="not a format-2 inner checkpoint"):
        read_inner_checkpoint(path)


def test_the_tensors_are_saved_sharded_and_loaded_exactly(tmp_path: Path) -> None:
    """One process here; the worker group's ranks each save and load their own shards."""
    path = HandoffDir(tmp_path).inner_checkpoint_path("llm")
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 3)).pow(2).sum().backward()
        optimizer.step()
    save_inner_tensors(model, optimizer, path)
    write_inner_checkpoint(path, checkpoint())
    assert (tmp_path / "jobs/llm/inner-checkpoint/.metadata").is_file()
    other = torch.nn.Linear(3, 2)
    restored = torch.optim.AdamW(other.parameters(), lr=0.1)
    load_inner_tensors(other, restored, path)
    assert torch.equal(other.weight, model.weight)
    assert torch.equal(other.bias, model.bias)
    mine, theirs = restored.state_dict()["state"], optimizer.state_dict()["state"]
    assert all(torch.equal(mine[0][k], v) for k, v in theirs[0].items())
    discard_inner_checkpoint(path)
    assert not path.exists()
    assert not (tmp_path / "jobs/llm/inner-checkpoint").exists()


def test_forgetting_the_job_removes_its_inner_checkpoint(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    path = handoff.inner_checkpoint_path("llm")
    layer = torch.nn.Linear(2, 2)
    save_inner_tensors(layer, torch.optim.SGD(layer.parameters(), lr=0.1), path)
    write_inner_checkpoint(path, checkpoint())
    handoff.forget_job("llm")
    assert not path.exists()
    assert not path.with_suffix("").exists()
