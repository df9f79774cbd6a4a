"""overlap: delayed: the correction rule, its decisions, and what crosses the hand-off."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from geofed.control import RoundAnnouncement
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.errors import InvalidHandoffData
from regional_agent.handoff.messages import (
    BaseReady,
    RoundInstruction,
    RoundSummary,
)
from regional_agent.handoff.overlap import (
    add_progress,
    apply_correction,
    keeps_speculation,
    next_instruction,
    progress_in_place,
    speculate_next,
    speculation_unusable,
    take_snapshot,
)

TRAINED = RoundInstruction(
    job="job-a",
    round=3,
    base_params="/state/params/round-3.pt",
    inner_steps=5,
    task="tests.support.tiny_task:TinyTask",
    task_options={"hidden": 8},
    seed=1,
    region="eu-west",
    region_index=0,
    num_regions=2,
    overlap="delayed",
)


def _state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 3, generator=generator),
        "b": torch.randn(3, generator=generator),
    }


# -- the correction ------------------------------------------------------------------


def test_the_correction_leaves_theta_plus_the_progress_made_since_the_snapshot() -> None:
    theta_r, theta_next = _state(0), _state(1)
    p_r = _state(2)  # progress of round r
    y = {k: theta_r[k] + p_r[k] for k in theta_r}
    snapshot = take_snapshot(y)
    p_next = _state(3)  # steps of round r+1 taken before θ_{r+1} came
    for k in y:
        y[k].add_(p_next[k])
    apply_correction(y, theta_next, snapshot)
    for k in y:
        torch.testing.assert_close(y[k], theta_next[k] + p_next[k])
    # The delta the agent forms is the progress of round r+1 alone, against θ_{r+1}.
    for k in y:
        torch.testing.assert_close(y[k] - theta_next[k], p_next[k])


def test_the_correction_is_y_plus_theta_minus_snapshot_and_keeps_tensor_identity() -> None:
    y, theta, s = _state(4), _state(5), _state(6)
    expected = {k: y[k] + (theta[k] - s[k]) for k in y}
    originals = {k: id(v) for k, v in y.items()}
    apply_correction(y, theta, {k: v.clone() for k, v in s.items()})
    for k in y:
        torch.testing.assert_close(y[k], expected[k])
        assert id(y[k]) == originals[k]  # in place: an optimizer's references stay valid


def test_the_correction_works_shard_by_shard() -> None:
    """Under FSDP each rank corrects its own shard; the whole equals the unsharded result."""
    y, theta, s = _state(7), _state(8), _state(9)
    whole = {k: v.clone() for k, v in y.items()}
    apply_correction(whole, theta, {k: v.clone() for k, v in s.items()})
    for rank in range(2):
        shard = {k: v.chunk(2, dim=0)[rank] for k, v in y.items()}  # views of y
        theta_shard = {k: v.chunk(2, dim=0)[rank] for k, v in theta.items()}
        snap = take_snapshot({k: v.chunk(2, dim=0)[rank] for k, v in s.items()})
        apply_correction(shard, theta_shard, snap)
    for k in y:
        torch.testing.assert_close(y[k], whole[k])


def test_the_two_halves_let_theta_be_loaded_in_between() -> None:
    """What the workers do: progress = y - S, load θ into y in place, add the progress."""
    y, theta, s = _state(10), _state(11), _state(12)
    expected = {k: theta[k] + (y[k] - s[k]) for k in y}
    progress = progress_in_place(s, y)
    for k in y:
        y[k].copy_(theta[k])
    add_progress(y, progress)
    for k in y:
        torch.testing.assert_close(y[k], expected[k])


def test_mismatched_tensors_are_refused() -> None:
    y = _state(0)
    with pytest.raises(ValueError, match="names differ"):
        apply_correction(y, {"w": y["w"]}, take_snapshot(y))
    with pytest.raises(ValueError, match="shape"):
        apply_correction(y, {"w": torch.zeros(2, 3), "b": y["b"]}, take_snapshot(y))


# -- decisions ----------------------------------------------------------------------


def test_speculation_only_for_delayed_jobs_with_a_next_round() -> None:
    assert speculate_next("delayed", 0, 5)
    assert speculate_next("delayed", 3, 5)
    assert not speculate_next("delayed", 4, 5)  # the last round: no θ would come
    assert speculate_next("delayed", 4, None)
    assert not speculate_next("none", 0, 5)


def test_the_speculative_instruction_continues_with_the_same_settings() -> None:
    spec = next_instruction(TRAINED, "/state/params/round-4.pt")
    assert (spec.round, spec.base_params, spec.base_pending) == (
        4,
        "/state/params/round-4.pt",
        True,
    )
    assert spec.overlap == "delayed"
    wanted = replace(TRAINED, round=4, base_params="/state/params/round-4.pt", evaluate_base=True)
    assert speculation_unusable(spec, wanted, resync=False) is None
    # θ_4's hash, known once it is there, is no change: its base-ready marker brings it.
    hashed = replace(wanted, base_hash="ab" * 32)
    assert speculation_unusable(spec, hashed, resync=False) is None


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"region_index": 1}, "region_index"),
        ({"num_regions": 3, "region_index": 2}, "region_index"),
        ({"inner_steps": 6}, "inner_steps"),
        ({"base_params": "/elsewhere/round-4.pt"}, "promised"),
        ({"round": 5}, "not the announced one"),
    ],
)
def test_a_speculative_round_that_differs_from_the_announced_one_is_unusable(
    change: dict[str, object], expected: str
) -> None:
    spec = next_instruction(TRAINED, "/state/params/round-4.pt")
    fields: dict[str, object] = {"round": 4, "base_params": "/state/params/round-4.pt", **change}
    wanted = replace(TRAINED, **fields)  # type: ignore[arg-type]
    reason = speculation_unusable(spec, wanted, resync=False)
    assert reason is not None
    assert expected in reason


def test_a_resync_drops_the_speculative_round() -> None:
    spec = next_instruction(TRAINED, "/p/round-4.pt")
    wanted = replace(TRAINED, round=4, base_params="/p/round-4.pt")
    assert speculation_unusable(spec, wanted, resync=True) == "the region resyncs its parameters"


@pytest.mark.parametrize(
    ("round_", "state", "participates", "kept"),
    [
        (3, "open", True, True),  # round r still uploading
        (3, "closed", True, True),  # round r aggregating
        (4, "open", True, True),  # round r+1 opened: its θ comes
        (4, "open", False, False),  # left out of round r+1
        (4, "paused", True, False),
        (4, "cancelled", True, False),
        (4, "done", True, False),
        (5, "open", True, False),  # a round skipped
        (2, "open", True, False),  # a coordinator restored from an older backup
    ],
)
def test_which_announcements_keep_the_speculative_round(
    round_: int, state: str, participates: bool, kept: bool
) -> None:
    reason = keeps_speculation(4, round_, state, participates)
    assert (reason is None) == kept, reason


# -- hand-off and control messages --------------------------------------------------


def test_instructions_carry_the_overlap_fields_through_json() -> None:
    spec = next_instruction(TRAINED, "/p/round-4.pt")
    assert RoundInstruction.from_json(spec.to_json()) == spec
    data = json.loads(spec.to_json())
    assert (data["overlap"], data["base_pending"]) == ("delayed", True)
    # An instruction written without them is a serial round.
    for key in ("overlap", "base_pending"):
        del data[key]
    plain = RoundInstruction.from_json(json.dumps(data).encode())
    assert (plain.overlap, plain.base_pending) == ("none", False)


def test_bad_overlap_fields_are_refused() -> None:
    with pytest.raises(InvalidHandoffData, match="overlap must be none, delayed or streaming"):
        replace(TRAINED, overlap="sometimes")
    with pytest.raises(InvalidHandoffData, match="base_pending is for rounds"):
        replace(TRAINED, overlap="none", base_pending=True)
    # A streaming round always hands over its fragment's delta.
    with pytest.raises(InvalidHandoffData, match="naming the fragment's tensors"):
        replace(TRAINED, overlap="streaming")


def test_summaries_carry_the_delayed_round_measurements() -> None:
    summary = RoundSummary(
        job="job-a",
        round=4,
        steps=5,
        tokens=10,
        mean_loss=1.0,
        cursor=25,
        base_params_hash="b" * 64,
        params_hash="p" * 64,
        world_size=2,
        train_seconds=1.0,
        train_started_at=1700000000.5,
        train_finished_at=1700000001.5,
        base_wait_seconds=0.25,
        base_folded_at_step=2,
    )
    assert RoundSummary.from_json(summary.to_json()) == summary
    with pytest.raises(InvalidHandoffData, match="base_wait_seconds"):
        replace(summary, base_wait_seconds=float("nan"))
    with pytest.raises(InvalidHandoffData, match="base_folded_at_step"):
        replace(summary, base_folded_at_step=-1)


def test_base_ready_and_cancel_markers(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    assert handoff.read_base_ready("job-a", 4) is None
    ready = BaseReady("job-a", 4, "/p/round-4.pt", "h" * 64, evaluate_base=True)
    handoff.write_base_ready(ready)
    assert handoff.read_base_ready("job-a", 4) == ready
    handoff.base_ready_path("job-a", 5).write_text('{"job": "job-a"}')
    with pytest.raises(InvalidHandoffData, match="missing fields"):
        handoff.read_base_ready("job-a", 5)
    assert not handoff.cancel_requested("job-a", 4)
    handoff.request_cancel("job-a", 4)
    assert handoff.cancel_requested("job-a", 4)
    handoff.clear_cancel("job-a", 4)
    assert not handoff.cancel_requested("job-a", 4)
    handoff.request_cancel("job-a", 4)
    handoff.prune_rounds("job-a", 6)  # markers go with their round
    assert not handoff.cancel_requested("job-a", 4)
    assert handoff.read_base_ready("job-a", 4) is None


def test_announcements_carry_the_overlap_mode() -> None:
    fields = {
        "job": "job-a",
        "round": 0,
        "base_round": 0,
        "base_hash": "a" * 64,
        "participants": ["eu-west"],
        "min_regions": 1,
        "deadline": "2026-01-01T00:00:00Z",
        "deadline_s": 60.0,
        "inner_steps": 5,
        "codec": {"scheme": "int8"},
        "task": "tests.support.tiny_task:TinyTask",
        "seed": 0,
        "state": "open",
        "message_id": "00000000-0000-4000-8000-000000000000",
        "sent_at": "2026-01-01T00:00:00Z",
        "type": "round_announcement",
    }
    plain = RoundAnnouncement.model_validate_json(json.dumps(fields))
    assert plain.overlap == "none"
    delayed = RoundAnnouncement.model_validate_json(json.dumps({**fields, "overlap": "delayed"}))
    assert delayed.overlap == "delayed"
