"""The agent <-> rank-0 file protocol: value types, markers, pending instructions, pruning."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from geofed.training_config import LrSchedule, TrainingConfig
from regional_agent.handoff.directory import ErrorMarker, HandoffDir
from regional_agent.handoff.errors import HandoffError, InvalidHandoffData
from regional_agent.handoff.messages import (
    RankStatus,
    RegionalCheckpoint,
    RoundInstruction,
    RoundProgress,
    RoundSummary,
)
from regional_agent.worker.optimizer_checkpoint import load_optimizer, save_optimizer
from tests.support.handoff_samples import INSTRUCTION, PARAMS, SUMMARY


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


TRAINED = replace(
    INSTRUCTION,
    training=TrainingConfig(
        parallelism="fsdp",
        precision="bf16",
        grad_clip_norm=0.5,
        grad_accumulation=2,
        lr_schedule=LrSchedule(kind="warmup_cosine", warmup_steps=20, min_lr_ratio=0.1),
    ),
    total_steps=1000,
)


def test_instruction_round_trips_through_json() -> None:
    assert RoundInstruction.from_json(INSTRUCTION.to_json()) == INSTRUCTION
    assert RoundInstruction.from_json(TRAINED.to_json()) == TRAINED
    assert json.loads(TRAINED.to_json())["training"] == TRAINED.training.record()


def test_an_instruction_may_ask_to_evaluate_the_base_first() -> None:
    asked = replace(TRAINED, evaluate_base=True)
    assert RoundInstruction.from_json(asked.to_json()) == asked
    data = json.loads(asked.to_json())
    del data["evaluate_base"]  # written by an agent that never asks
    assert RoundInstruction.from_json(json.dumps(data).encode()).evaluate_base is False
    with pytest.raises(InvalidHandoffData, match="evaluate_base must be a bool"):
        replace(TRAINED, evaluate_base=1)  # type: ignore[arg-type]


def test_a_summary_carries_the_base_evaluation_when_there_is_one() -> None:
    evaluated = replace(SUMMARY, base_eval={"val_loss": 2.5, "val_bits_per_byte": 3.6})
    assert RoundSummary.from_json(evaluated.to_json()) == evaluated
    data = json.loads(SUMMARY.to_json())
    del data["base_eval"]  # a done marker of a worker that never evaluated
    assert RoundSummary.from_json(json.dumps(data).encode()) == SUMMARY
    for bad in ({"val_loss": float("nan")}, {"val_loss": "2"}, [2.5]):
        with pytest.raises(InvalidHandoffData, match="base_eval"):
            replace(SUMMARY, base_eval=bad)  # type: ignore[arg-type]


def test_an_instruction_without_training_trains_with_the_defaults() -> None:
    data = json.loads(TRAINED.to_json())
    del data["training"], data["total_steps"]
    instruction = RoundInstruction.from_json(json.dumps(data).encode())
    assert (instruction.training, instruction.total_steps) == (TrainingConfig(), None)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"job": "Job_A"}, "invalid job"),
        ({"region": ""}, "invalid region"),
        ({"round": -1}, "round must be an integer >= 0"),
        ({"round": True}, "round must be an integer"),
        ({"inner_steps": 0}, "inner_steps must be an integer >= 1"),
        ({"region_index": 2}, "region_index 2 is not below num_regions 2"),
        ({"base_params": ""}, "base_params must be a non-empty string"),
        ({"base_params": "base.pt"}, "base_params must be an absolute path"),
        ({"task_options": {"x": float("nan")}}, "task_options must be plain JSON"),
        ({"task_options": {"x": object()}}, "task_options must be plain JSON"),
        ({"training": {"precision": "bf16"}}, "training must be a TrainingConfig"),
        ({"total_steps": 0}, "total_steps must be an integer >= 1"),
        (
            {"training": TrainingConfig(lr_schedule=LrSchedule(kind="warmup_cosine"))},
            "a warmup_cosine schedule needs total_steps",
        ),
    ],
)
def test_instruction_rejects_bad_fields(change: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidHandoffData, match=message):
        replace(INSTRUCTION, **change)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"not json", "instruction"),
        (b"[]", "must be a JSON object"),
        (json.dumps({"job": "a"}).encode(), "missing fields"),
        (
            json.dumps({**json.loads(INSTRUCTION.to_json()), "extra": 1}).encode(),
            r"unknown fields \['extra'\]",
        ),
        (json.dumps({**json.loads(INSTRUCTION.to_json()), "format": 2}).encode(), "format 2"),
        (
            json.dumps({**json.loads(INSTRUCTION.to_json()), "training": {"fsdp": True}}).encode(),
            "training.fsdp",
        ),
    ],
)
def test_instruction_file_errors_name_the_problem(raw: bytes, message: str) -> None:
    with pytest.raises(InvalidHandoffData, match=message):
        RoundInstruction.from_json(raw)


def test_summary_rejects_non_finite_loss() -> None:
    with pytest.raises(InvalidHandoffData, match="mean_loss must be a finite number"):
        replace(SUMMARY, mean_loss=float("inf"))


def test_instruction_is_written_atomically_and_read_back(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    path = handoff.write_instruction(INSTRUCTION)
    assert path == tmp_path / "jobs" / "job-a" / "round-3.instruction.json"
    assert handoff.read_instruction("job-a", 3) == INSTRUCTION
    assert temp_files(tmp_path) == []


def test_instruction_under_the_wrong_name_is_rejected(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    handoff.write_instruction(INSTRUCTION)
    handoff.instruction_path("job-a", 3).rename(handoff.instruction_path("job-a", 4))
    with pytest.raises(InvalidHandoffData, match="not job 'job-a' round 4"):
        handoff.read_instruction("job-a", 4)


def test_pending_instruction_is_the_newest_without_an_outcome(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    assert handoff.pending_instruction() is None
    handoff.write_instruction(INSTRUCTION)
    later = replace(INSTRUCTION, job="job-b", round=0)
    handoff.write_instruction(later)
    os.utime(handoff.instruction_path("job-a", 3), ns=(1_000, 1_000))
    os.utime(handoff.instruction_path("job-b", 0), ns=(2_000, 2_000))
    assert handoff.pending_instruction() == ("job-b", 0)

    handoff.write_error("job-b", 0, "nope")
    # The older instruction was superseded: it is not served after the newer one ends.
    assert handoff.pending_instruction() is None
    handoff.clear_error("job-b", 0)
    assert handoff.pending_instruction() == ("job-b", 0)

    handoff.write_instruction(INSTRUCTION)  # rewriting makes it the newest
    assert handoff.pending_instruction() == ("job-a", 3)
    handoff.write_result(SUMMARY, PARAMS)
    assert handoff.pending_instruction() == ("job-a", 3)  # no marker yet
    handoff.write_done(SUMMARY)
    assert handoff.pending_instruction() is None


def test_a_result_exists_only_once_its_marker_does(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    with pytest.raises(HandoffError, match="a done marker must follow its result"):
        handoff.write_done(SUMMARY)
    assert handoff.read_done("job-a", 3) is None

    handoff.write_result(SUMMARY, PARAMS)
    assert handoff.read_completed("job-a", 3) is None
    assert handoff.read_result_file("job-a", 3).summary == SUMMARY

    handoff.write_done(SUMMARY)
    completed = handoff.read_completed("job-a", 3)
    assert completed is not None
    assert completed.summary == SUMMARY
    assert completed.params.keys() == PARAMS.keys()
    assert all(torch.equal(completed.params[k], v) for k, v in PARAMS.items())
    assert temp_files(tmp_path) == []


def test_result_that_disagrees_with_its_marker_is_rejected(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    handoff.write_result(SUMMARY, PARAMS)
    handoff.write_done(SUMMARY)
    handoff.write_result(replace(SUMMARY, tokens=1), PARAMS)
    with pytest.raises(InvalidHandoffData, match="does not match its done marker"):
        handoff.read_completed("job-a", 3)


def test_truncated_result_is_reported_not_loaded(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    handoff.write_result(SUMMARY, PARAMS)
    path = handoff.result_path("job-a", 3)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(InvalidHandoffData, match="unreadable result"):
        handoff.read_result_file("job-a", 3)


def test_checkpoint_keeps_optimizer_state_exactly(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 3)).pow(2).sum().backward()
        optimizer.step()
    handoff = HandoffDir(tmp_path)
    assert handoff.read_checkpoint("job-a") is None
    save_optimizer(model, optimizer, handoff.optimizer_path("job-a", 5))
    handoff.write_checkpoint(RegionalCheckpoint("job-a", 5, 300, 2, optimizer_round=5))

    loaded = handoff.read_checkpoint("job-a")
    assert loaded is not None
    assert (loaded.job, loaded.last_round, loaded.cursor, loaded.world_size) == ("job-a", 5, 300, 2)
    assert loaded.optimizer_round == 5
    other = torch.nn.Linear(3, 2)
    restored = torch.optim.AdamW(other.parameters(), lr=0.1)
    load_optimizer(other, restored, handoff.optimizer_path("job-a", 5))
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(restored.state_dict()["state"][index][key], value)
    assert temp_files(tmp_path) == []


def test_corrupt_checkpoint_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    handoff.checkpoint_path("job-a").parent.mkdir(parents=True)
    handoff.checkpoint_path("job-a").write_bytes(b"garbage")
    with pytest.raises(InvalidHandoffData, match="not JSON"):
        handoff.read_checkpoint("job-a")
    handoff.checkpoint_path("job-a").unlink()
    # A whole-state checkpoint of the format before, damaged.
    handoff.whole_checkpoint_path("job-a").write_bytes(b"garbage")
    with pytest.raises(InvalidHandoffData, match="unreadable regional checkpoint"):
        handoff.read_checkpoint("job-a")
    torch.save({"format": 1, "job": "job-a"}, handoff.whole_checkpoint_path("job-a"))
    with pytest.raises(InvalidHandoffData, match="last_round"):
        handoff.read_checkpoint("job-a")


def test_prune_removes_older_rounds_marker_first(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    for round_ in range(4):
        summary = replace(SUMMARY, round=round_)
        handoff.write_instruction(replace(INSTRUCTION, round=round_))
        handoff.write_result(summary, PARAMS)
        handoff.write_done(summary)
    handoff.write_progress(RoundProgress("job-a", 1, 5, 50))
    assert handoff.prune_rounds("job-a", before_round=2) == 2
    remaining = sorted(p.name for p in handoff.job_dir("job-a").iterdir())
    assert remaining == [
        f"round-{r}.{suffix}"
        for r in (2, 3)
        for suffix in ("done.json", "instruction.json", "result.pt")
    ]
    assert handoff.prune_rounds("job-unknown", before_round=9) == 0


def test_error_and_progress_markers(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    assert handoff.read_error("job-a", 1) is None
    handoff.write_error("job-a", 1, "rank 1: boom")
    assert handoff.read_error("job-a", 1) == "rank 1: boom"
    assert handoff.read_error_marker("job-a", 1) == ErrorMarker("rank 1: boom", refused=False)
    handoff.clear_error("job-a", 1)
    assert handoff.read_error("job-a", 1) is None
    # The workers declining a round (the task's files differ) say so in the marker.
    handoff.write_error("job-a", 2, "rank 0: TaskFilesDiffer: ...", refused=True)
    assert handoff.read_error_marker("job-a", 2) == ErrorMarker(
        "rank 0: TaskFilesDiffer: ...", refused=True
    )
    handoff.error_path("job-a", 2).write_text('{"message": "m", "refused": "yes"}')
    assert handoff.read_error_marker("job-a", 2) == ErrorMarker("m", refused=False)
    handoff.error_path("job-a", 2).write_text("[1]")
    marker = handoff.read_error_marker("job-a", 2)
    assert marker is not None
    assert marker.message.startswith("unreadable error marker")

    assert handoff.read_progress("job-a", 1) is None
    handoff.write_progress(RoundProgress("job-a", 1, 7, 50))
    assert handoff.read_progress("job-a", 1) == RoundProgress("job-a", 1, 7, 50)
    assert temp_files(tmp_path) == []


def test_stop_flag_and_rank_statuses(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    assert not handoff.stop_requested()
    handoff.request_stop()
    assert handoff.stop_requested()
    handoff.clear_stop()
    assert not handoff.stop_requested()

    status = RankStatus(1, 1, 2, 4242, "launch", 0, "gloo", "cpu", "ready")
    handoff.write_rank_status(status)
    handoff.rank_status_path(0).write_text("{ torn")
    assert handoff.read_rank_statuses() == [status]


def test_paths_refuse_bad_names(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    with pytest.raises(ValueError, match="invalid job"):
        handoff.instruction_path("../escape", 0)
    with pytest.raises(InvalidHandoffData, match="round must be"):
        handoff.result_path("job-a", -1)


def test_a_message_names_every_problem_and_refuses_unknown_fields() -> None:
    with pytest.raises(InvalidHandoffData) as raised:
        replace(SUMMARY, round=-1, mean_loss=float("nan"), params_hash="")
    message = str(raised.value)
    assert "round must be an integer >= 0, got -1" in message
    assert "mean_loss must be a finite number" in message
    assert "params_hash must be a non-empty string" in message
    make_progress: Any = RoundProgress
    with pytest.raises(InvalidHandoffData, match="ranks: Unexpected keyword argument"):
        make_progress("job-a", 1, 5, 50, ranks=2)
    with pytest.raises(InvalidHandoffData, match="state must be starting or ready"):
        RankStatus(1, 1, 2, 4242, "launch", 0, "gloo", "cpu", "running")
    with pytest.raises(InvalidHandoffData, match="pid must be an integer >= 1"):
        RankStatus(1, 1, 2, 0, "launch", 0, "gloo", "cpu", "ready")


def test_advisory_files_holding_bad_values_are_ignored(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    handoff.progress_path("job-a", 1).parent.mkdir(parents=True)
    progress = {"job": "job-a", "round": 1, "steps_done": -3, "inner_steps": 50}
    handoff.progress_path("job-a", 1).write_text(json.dumps(progress))
    assert handoff.read_progress("job-a", 1) is None
    status = RankStatus(1, 1, 2, 4242, "launch", 0, "gloo", "cpu", "ready")
    handoff.write_rank_status(status)
    bad = {**json.loads(handoff.rank_status_path(1).read_text()), "rank": 0, "world_size": 0}
    handoff.rank_status_path(0).write_text(json.dumps(bad))
    assert handoff.read_rank_statuses() == [status]
